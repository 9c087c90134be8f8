"""How the cross-framework equivalence check judges a run: its bounds, and each run's
deviations from the one-process float64 numpy reference, as a table and a plot.

``python -m adapters.equivalence`` runs the check: it launches the backends, so it lives with
them, and the toolkit below never imports the adapters. This module is the framework-free part
that command and the tests share. The model, optimizer and data presets are
``toolkit.equivalence_problem``'s, importable from here too.
"""

from __future__ import annotations

import numpy as np

from toolkit.equivalence_problem import (  # noqa: F401  (the presets, importable from here)
    GPT_WINDOWS,
    load_data,
    make_model,
    make_optimizer,
    reference,
    stdlib_bytes,
)

# Bounds on the max relative per-step loss deviation (and on the parameters' max absolute
# deviation) from the float64 reference.
LOSS_TOLERANCE = {"float32": 1e-5, "float64": 1e-10, "bf16-mixed": 3e-3, "fp16-mixed": 1e-3}
PARAM_TOLERANCE = {"float32": 1e-5, "float64": 1e-10, "bf16-mixed": 2e-3, "fp16-mixed": 2e-3}
# mixed precision: the first steps, before rounding boundaries move (docs/precision.md), are
# held to a bound a float32 run fails
EARLY_TOLERANCE = {"bf16-mixed": (10, 1e-6), "fp16-mixed": (10, 1.5e-6)}


def _comparable(name: str, array: np.ndarray) -> np.ndarray:
    """A parameter as compared: a transformer's key bias (the middle third of ``qkv.bias``)
    is left out. It does not change the function (softmax over keys is shift-invariant per
    query), so its gradient is exactly zero plus rounding noise, which Adam's normalisation
    turns into +-lr steps that differ between frameworks."""
    if name.endswith("attn.qkv.bias"):
        third = len(array) // 3
        return np.delete(array, np.s_[third:2 * third])
    return array


def compare(result: dict, ref_losses: list[float], ref_params: dict, dtype: str,
            ref_norms: list[float] | None = None) -> dict:
    """The run's deviations from the reference; with clipping, its gradient norms before
    clipping are held to the loss bound too."""
    if result["status"] != "ok":
        return result
    losses, ref = np.asarray(result["losses"]), np.asarray(ref_losses)
    if losses.shape != ref.shape:
        return {**result, "status": "fail", "reason": f"{len(losses)} steps, expected {len(ref)}"}
    params = result.pop("params")
    loss_dev = float(np.max(np.abs(losses - ref) / np.abs(ref)))
    param_dev = max(float(np.max(np.abs(_comparable(k, params[k].astype(np.float64))
                                        - _comparable(k, v)))) for k, v in ref_params.items())
    passed = loss_dev <= LOSS_TOLERANCE[dtype] and param_dev <= PARAM_TOLERANCE[dtype]
    if dtype in EARLY_TOLERANCE:
        steps, bound = EARLY_TOLERANCE[dtype]
        result["early_rel_loss_dev"] = float(np.max(np.abs(losses - ref)[:steps]
                                                    / np.abs(ref)[:steps]))
        passed = passed and result["early_rel_loss_dev"] <= bound
    if ref_norms is not None:
        norms = np.asarray(result.get("grad_norms", []))
        if norms.shape != np.shape(ref_norms):
            return {**result, "status": "fail", "reason": "no gradient norm for every step"}
        result["max_rel_norm_dev"] = float(np.max(np.abs(norms - ref_norms) / ref_norms))
        passed = passed and result["max_rel_norm_dev"] <= LOSS_TOLERANCE[dtype]
    return {**result, "final_loss": float(losses[-1]), "max_rel_loss_dev": loss_dev,
            "max_abs_param_dev": param_dev, "status": "pass" if passed else "fail"}


def format_table(rows: list[dict], baseline: dict[tuple[int, str], float]) -> str:
    header = ("backend", "world", "launcher", "layout", "device", "final loss", "max rel loss dev",
              "max abs param dev", "ms/step", "vs first", "result")
    lines = [header]
    for r in rows:
        ok = "final_loss" in r
        step_ms = r.get("step_seconds", 0) * 1e3
        base = baseline.get((r["world_size"], r.get("layout", "data_parallel")))
        lines.append((
            r["backend"], str(r["world_size"]), r["launcher"], r.get("layout", "data_parallel"),
            r.get("device", "-"),
            f"{r['final_loss']:.8f}" if ok else "-",
            f"{r['max_rel_loss_dev']:.2e}" if ok else "-",
            f"{r['max_abs_param_dev']:.2e}" if ok else "-",
            f"{step_ms:.2f}" if ok else "-",
            f"{r['step_seconds'] / base:.2f}x" if ok and base else "-",
            r["status"].upper() + (f" ({r['reason']})" if r.get("reason") else ""),
        ))
    widths = [max(len(line[i]) for line in lines[:]) for i in range(len(header) - 1)]
    out = []
    for line in lines:
        out.append("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=False))
                   + "  " + line[-1])
    return "\n".join(out)


def plot(path: str, ref_losses, rows) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    steps = np.arange(1, len(ref_losses) + 1)
    top.plot(steps, ref_losses, "k-", lw=3, alpha=0.3, label="numpy float64 reference")
    for r in rows:
        if "final_loss" in r:
            label = f"{r['backend']} x{r['world_size']}"
            top.plot(steps, r["losses"], lw=1, label=label)
            dev = np.abs(np.asarray(r["losses"]) - ref_losses) / np.abs(ref_losses)
            bottom.semilogy(steps, np.maximum(dev, 1e-18), lw=1, label=label)
    top.set_ylabel("training loss")
    top.legend(fontsize=8)
    bottom.set_ylabel("relative deviation from reference")
    bottom.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":  # the command is the adapters' (it launches the backends)
    import sys

    from toolkit.errors import ToolkitError

    err = ToolkitError("python -m toolkit.equivalence runs no check: the check launches the "
                       "backends, which the toolkit never imports",
                       "run python -m adapters.equivalence (the same options)")
    print(f"error: {err}", file=sys.stderr)
    sys.exit(2)
