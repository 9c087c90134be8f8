"""Evaluation split across ranks (the Trainer's ``evaluate``), and the check of user metrics."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from toolkit.contract import Adapter
from toolkit.data.dataset import Dataset
from toolkit.data.prefetch import load_batch
from toolkit.data.sampler import shard_indices
from toolkit.errors import ToolkitError
from toolkit.launch.env import LaunchEnv


def evaluate(adapter: Adapter, env: LaunchEnv, layout: Any, dataset: Dataset,
             eval_batch_size: int, metrics: dict[str, Any],
             with_accuracy: bool) -> dict[str, float]:
    """Loss (accuracy when ``with_accuracy``, and each of ``metrics``) over all of ``dataset``.

    Each rank evaluates its strided share in chunks of at most ``eval_batch_size`` samples;
    sums are added across ranks, so the result is exactly that of one process evaluating
    everything.
    """
    adapter.sync_state()  # every rank evaluates with rank 0's BatchNorm statistics
    world, rank = env.world_size, env.rank
    idx = shard_indices(len(dataset), world, rank)
    if len(dataset) < world and layout.collective_forward:
        # A rank without samples would skip evaluate(), whose collectives the others wait in.
        raise ToolkitError(f"the evaluation data has {len(dataset)} samples, fewer than the "
                           f"{world} ranks of layout {layout.name!r}",
                           "evaluate on at least one sample per rank")
    # Every rank makes the same number of adapter.evaluate calls (a sharded model may
    # gather its parameters in each): as many as the largest share needs.
    calls = max(1, math.ceil(math.ceil(len(dataset) / world) / eval_batch_size))
    keys = ("loss_sum", "correct", "count", *metrics)
    local = np.zeros(len(keys))
    for part in np.array_split(idx, calls):
        if len(part):
            sums = adapter.evaluate(*load_batch(dataset, part))
            local += [float(sums.get(k, 0.0)) for k in keys]
    sums = adapter.allreduce(local, "sum")
    out = {"val_loss": float(sums[0] / sums[2])}
    if with_accuracy:
        out["val_accuracy"] = float(sums[1] / sums[2])
    out.update({f"val_{name}": float(sums[3 + i] / sums[2])
                for i, name in enumerate(metrics)})
    return out


def check_metrics(metrics: Any, builtin_accuracy: bool) -> dict[str, Any]:
    """Evaluation metrics: names (valid identifiers, not ``loss``; ``accuracy`` only when the
    loss is not ``cross_entropy``, which reports its own) to callables."""
    metrics = dict(metrics or {})
    taken = ("loss", "accuracy") if builtin_accuracy else ("loss",)
    for name, fn in metrics.items():
        if not (isinstance(name, str) and name.isidentifier()) or name in taken:
            raise ToolkitError(f"metric name {name!r} cannot be used",
                               f"use an identifier other than {' and '.join(map(repr, taken))} "
                               "(it is reported as val_<name>)")
        if not callable(fn):
            raise ToolkitError(f"metric {name!r} is {fn!r}, not a callable",
                               "pass fn(outputs, labels) -> one value per sample")
    return metrics
