"""The settings that define a run, recorded in every checkpoint and compared on resume.

A resume continues the run the checkpoint belongs to. Settings that change the training
trajectory (model, optimizer and its schedule, global batch, seed, shuffling, learning-rate
scaling, gradient clipping) must be the same, unless the user says the change is intended;
where the run happens (backend, layout, world size) may change freely, since checkpoints are
neutral, and is said.
"""

from __future__ import annotations

from typing import Any

from toolkit.errors import ToolkitError

# Where the run happens: a change is allowed and printed.
PLACEMENT = ("backend", "layout", "world_size")


def run_settings(*, model: Any, optimizer: Any, global_batch_size: int, seed: int,
                 shuffle: bool, drop_last: bool, lr_scaling: str, backend: str, layout: str,
                 world_size: int, clip_grad_norm: float | None = None,
                 loss_scaling: dict[str, Any] | None = None) -> dict[str, Any]:
    """The record of a run's defining settings (JSON values; ``model``/``optimizer`` as
    described by ``toolkit.checkpoint.resume.describe``, None for native objects;
    ``loss_scaling``: the fp16 loss scaler's settings, recorded only when the loss is scaled,
    so that they are compared only between two runs that scale it)."""
    settings = {"model": model, "optimizer": optimizer, "global_batch_size": global_batch_size,
                "seed": seed, "shuffle": shuffle, "drop_last": drop_last,
                "lr_scaling": lr_scaling, "backend": backend, "layout": layout,
                "world_size": world_size, "clip_grad_norm": clip_grad_norm}
    return settings if loss_scaling is None else {**settings, "loss_scaling": loss_scaling}


def saved_settings(meta: dict[str, Any]) -> dict[str, Any]:
    """The settings a checkpoint's metadata records (older checkpoints: what their other
    fields say; a setting they do not record is left out, never guessed)."""
    if "settings" in meta:
        return dict(meta["settings"])
    sampler = meta.get("sampler", {})
    found = {"model": meta.get("model"), "optimizer": meta.get("optimizer"),
             "global_batch_size": sampler.get("global_batch_size"),
             "seed": meta.get("rng", {}).get("seed"), "shuffle": sampler.get("shuffle"),
             "drop_last": sampler.get("drop_last"), "backend": meta.get("backend"),
             "layout": meta.get("layout"), "world_size": meta.get("world_size")}
    return {k: v for k, v in found.items() if v is not None or k in ("model", "optimizer")}


def _flat(value: Any, prefix: str) -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flat(item, f"{prefix}.{key}"))
        return out
    return {prefix: value}


def differences(saved: dict[str, Any], now: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(setting, old, new)`` for every setting recorded in both that differs, nested
    values by dotted name (``optimizer.lr.total_steps``)."""
    out = []
    for key in now:
        if key not in saved:
            continue
        old, new = _flat(saved[key], key), _flat(now[key], key)
        for name in sorted(set(old) | set(new)):  # (a field an older record lacks is None)
            if old.get(name) != new.get(name):
                out.append((name, old.get(name), new.get(name)))
    return out


def describe_changes(changes: list[tuple[str, Any, Any]]) -> str:
    return "; ".join(f"{name} {old!r} -> {new!r}" for name, old, new in changes)


def classify(saved: dict[str, Any], now: dict[str, Any]) -> tuple[list, list]:
    """``(trajectory changes, placement changes)`` between a checkpoint's settings and a
    run's."""
    changes = differences(saved, now)
    placement = [c for c in changes if c[0].split(".")[0] in PLACEMENT]
    return [c for c in changes if c not in placement], placement


def refuse_changes(path: Any, trajectory: list[tuple[str, Any, Any]]) -> None:
    """The error for resuming ``path`` with ``trajectory`` changes the user did not allow."""
    if trajectory:
        raise ToolkitError(
            f"resuming {path} would change the run it continues: "
            f"{describe_changes(trajectory)}",
            "rerun with the settings the checkpoint records, or pass --allow-changes "
            "(Trainer(allow_changes=True)) to go on with the new ones on purpose; a new run "
            "belongs in another checkpoint directory")
