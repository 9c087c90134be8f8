"""Resuming a Trainer from a checkpoint: finding it, checking that it fits, loading it."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from toolkit.checkpoint.store import Checkpoint, CheckpointError, CheckpointStore, read_checkpoint
from toolkit.contract import Adapter
from toolkit.data.sampler import GlobalBatchSampler


def directory_contents(path: Path, limit: int = 5) -> str:
    """What ``path`` is, for an error saying it holds no checkpoint: ``does not exist``, ``is a
    file, not a directory``, ``is empty`` or ``holds a, b/ and 3 more`` (folders end in /)."""
    if not path.exists():
        return "does not exist"
    if not path.is_dir():
        return "is a file, not a directory"
    found = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    if not found:
        return "is empty"
    more = f" and {len(found) - limit} more" if len(found) > limit else ""
    return f"holds {', '.join(found[:limit])}{more}"


def find_checkpoint(resume: str | os.PathLike, store: CheckpointStore | None
                    ) -> Checkpoint | None:
    """The checkpoint ``resume`` names (``"latest"``: the store's newest; None if it is empty)."""
    if str(resume) != "latest":
        return read_checkpoint(Path(resume))
    assert store is not None
    if not store.checkpoints():
        return None
    return store.load("latest")


def restore(ckpt: Checkpoint, adapter: Adapter, sampler: GlobalBatchSampler,
            data_fingerprint: str | None, allow_changes: bool = False) -> None:
    """Loads ``ckpt`` into the adapter and the sampler after checking that it fits.

    Raises:
        CheckpointError: the checkpoint holds a native model written by another backend, was
            trained on data with another fingerprint, or its tensors do not match the model's
            names and shapes.
    """
    written_by = ckpt.meta.get("backend")
    if "model" in ckpt.meta and ckpt.meta["model"] is None and written_by != adapter.name:
        # A native model's names are its framework's own: only specs move between backends.
        raise CheckpointError(
            f"checkpoint {ckpt.path} holds a native model written by {written_by}, but this "
            f"run uses {adapter.name}",
            f"resume it with the backend that wrote it (--backend {written_by}); only the "
            "framework-neutral specs (toolkit.MLP, CNN, GPT) move between backends")
    saved = ckpt.meta.get("data_fingerprint")
    if saved is not None and data_fingerprint is not None and saved != data_fingerprint:
        raise CheckpointError(
            f"checkpoint {ckpt.path} was trained on the data set {saved}, but this run trains "
            f"on {data_fingerprint}",
            "resume with the data it was trained on (the same corpus, context and stride), "
            "or start a fresh run in another checkpoint directory without --resume")
    expected = adapter.state_dict()
    order = lambda n: (not n.startswith("params/"), n)  # noqa: E731  parameters first
    missing = sorted(set(expected) - set(ckpt.tensors), key=order)
    extra = sorted(set(ckpt.tensors) - set(expected), key=order)
    wrong = sorted((n for n in set(expected) & set(ckpt.tensors)
                    if expected[n].shape != ckpt.tensors[n].shape), key=order)
    if missing or extra or wrong:
        details = "; ".join(f"{what}: {', '.join(names[:5])}" + (
            f" and {len(names) - 5} more" if len(names) > 5 else "") for what, names in
                            (("missing", missing), ("unexpected", extra),
                             ("wrong shape", wrong)) if names)
        raise CheckpointError(f"checkpoint {ckpt.path} does not fit this model ({details})",
                              "resume with the model and optimizer that wrote it")
    adapter.load_state_dict(
        {n: a.astype(expected[n].dtype, copy=False) for n, a in ckpt.tensors.items()})
    sampler.load_state_dict(ckpt.meta["sampler"], allow_changes=allow_changes)


def describe(spec: Any) -> dict[str, Any] | None:
    """A spec as JSON (``{"type": "MLP", "sizes": [...], ...}``); None for native objects."""
    if not dataclasses.is_dataclass(spec):
        return None
    return {"type": type(spec).__name__, **json.loads(json.dumps(dataclasses.asdict(spec)))}
