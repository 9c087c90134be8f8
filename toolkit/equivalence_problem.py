"""What the equivalence check trains (``python -m adapters.equivalence``): its model,
optimizer and data presets, and the one-process numpy reference run of them that every backend
is compared with. Imports no framework."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from toolkit.errors import ToolkitError
from toolkit.models.specs import CNN, MLP, SGD, Adam, WarmupCosine

GPT_WINDOWS = 4096  # the GPT preset trains on the first windows of the text corpus


def make_model(name: str):
    """The model presets: ``mlp`` (64-128-10, relu), ``cnn`` (conv 3x3x8, relu, dense) and
    ``gpt`` (2 blocks, width 32, 2 heads, context 16, bytes)."""
    from toolkit.models.gpt import GPT

    models = {"mlp": lambda: MLP((64, 128, 10)),
              "cnn": lambda: CNN(image_shape=(8, 8, 1), channels=(8,), classes=10),
              "gpt": lambda: GPT(vocab=256, context=16, width=32, layers=2, heads=2)}
    if name not in models:
        raise ToolkitError(f"unknown model preset {name!r}", f"use one of: {', '.join(models)}")
    return models[name]()


def make_optimizer(name: str, steps: int):
    """The optimizer presets, each exercising a different part of the arithmetic."""
    optimizers = {
        "sgd": lambda: SGD(lr=0.05, momentum=0.9),
        "sgd-cosine": lambda: SGD(lr=WarmupCosine(0.1, max(1, steps // 5), steps),
                                  momentum=0.9, nesterov=True, weight_decay=1e-4),
        "adam": lambda: Adam(lr=1e-3),
        "adamw": lambda: Adam(lr=1e-3, weight_decay=0.01, decoupled=True),
    }
    if name not in optimizers:
        raise ToolkitError(f"unknown optimizer preset {name!r}",
                           f"use one of: {', '.join(optimizers)}")
    return optimizers[name]()


def load_data(model_name: str, dtype: str):
    """The presets' training data as arrays: digits, or for ``gpt`` the first
    ``GPT_WINDOWS`` non-overlapping 16-byte windows of the standard library's source text
    (inputs, and labels shifted by one byte; 64 KiB of text, the same on every machine with
    the same Python version)."""
    if model_name == "gpt":
        context = make_model("gpt").context
        tokens = stdlib_bytes(GPT_WINDOWS * context + 1).astype(np.int64)
        x = tokens[:-1].reshape(GPT_WINDOWS, context)
        y = tokens[1:].reshape(GPT_WINDOWS, context)
        return x, y
    from toolkit.datasets import load_digits

    (x, y), _ = load_digits(dtype=dtype)
    if model_name == "cnn":
        x = x.reshape(-1, 8, 8, 1)
    return x, y


def stdlib_bytes(n: int) -> np.ndarray:
    """The first ``n`` bytes of the standard library's ``.py`` sources (sorted paths)."""
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, have = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "dist-packages" in path.parts:
            continue
        chunks.append(path.read_bytes())
        have += len(chunks[-1])
        if have >= n:
            break
    return np.frombuffer(b"".join(chunks)[:n], np.uint8)


def reference(args, norms: list[float] | None = None, split: tuple[int, int] = (1, 1),
              part_weight: float = 1.0) -> tuple[list[float], dict[str, np.ndarray]]:
    """The one-process float64 numpy run every backend is compared with; under mixed
    precision, the float32 run of the same rounded arithmetic, each batch split over ``split``
    = ``(ranks, parts per rank)`` as the run splits it, each part's loss weighted by
    ``part_weight`` before its backward pass as the run weights it."""
    from toolkit.models.reference import reference_run
    from toolkit.precision import Precision

    policy = Precision.of(args.precision, args.dtype)
    dtype = "float32" if policy.mixed else "float64"
    x, y = load_data(args.model, dtype)
    mixed = {"compute": policy.compute_dtype, "split": split, "part_weight": part_weight,
             "scaler": policy.scaler()}
    return reference_run(make_model(args.model), make_optimizer(args.optimizer, args.steps),
                         "cross_entropy", x, y, global_batch_size=args.batch_size,
                         steps=args.steps, seed=args.seed, dtype=dtype,
                         clip_grad_norm=args.clip_grad_norm, norms=norms,
                         **(mixed if policy.mixed else {}))
