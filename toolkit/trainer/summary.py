"""What is running: the block rank 0 prints before the first step, and the metrics log's first
record, with the same facts."""

from __future__ import annotations

import math
import socket
from typing import Any

from toolkit.trainer.placement import format_placement, gather_nodes, placement_facts


def parameter_count(model: Any) -> int | None:
    """Parameters of a spec model (None for a native one: its framework counts them)."""
    shapes = getattr(model, "param_shapes", None)
    if callable(shapes):
        return sum(math.prod(s) for s in shapes().values())
    init = getattr(model, "init", None)
    if callable(init) and hasattr(model, "apply"):
        return sum(int(a.size) for a in init(0).values())
    return None


def run_facts(trainer: Any, samples: int) -> dict[str, Any]:
    """The start facts of ``trainer`` (a ``toolkit.Trainer`` after its set-up). A collective:
    every rank calls it (the ranks' hosts are gathered for the placement table)."""
    from toolkit.contract import DrivesDevices
    from toolkit.trainer.metrics import mfu_facts

    t, env = trainer, trainer.env
    drives = isinstance(t.adapter, DrivesDevices)
    nodes = gather_nodes(t.adapter.allreduce if env.is_distributed else None, env.world_size,
                         env.rank, socket.gethostname())
    names = t.adapter.device_names() if drives else ["1 device"]
    return {**start_facts(
        placement=placement_facts(nodes, t.layout, env.world_size,
                                  t.adapter.local_device_count() if drives else 1),
        backend=t.adapter.name, layout=t.layout, world_size=env.world_size,
        local_size=env.local_size, num_nodes=env.num_nodes,
        dtype=t.adapter.dtype_name if drives else None,
        precision=t.precision.name, devices=t.adapter.device_names() if drives else ["1 device"],
        global_batch=t.global_batch_size, local_batch=t.sampler.local_batch_size,
        accumulation_steps=t.accumulation_steps, model=t.model, samples=samples,
        steps_per_epoch=len(t.sampler), checkpoint_dir=t.checkpoints.directory,
        resumed_from=t.checkpoints.resumed_from, resumed_step=t.global_step),
        **mfu_facts(t.model, t.flops_per_sample, t.peak_flops, names,
                    t.precision.compute_dtype, env.world_size * len(names))}


def start_facts(*, backend: str, layout: Any, world_size: int, local_size: int, num_nodes: int,
                devices: list[str], dtype: str | None, global_batch: int, local_batch: int,
                accumulation_steps: int, model: Any, samples: int, steps_per_epoch: int,
                checkpoint_dir: Any, resumed_from: Any, resumed_step: int,
                precision: str | None = None,
                placement: dict[str, Any] | None = None) -> dict[str, Any]:
    """The facts of a run's start, as JSON values (``placement``: the table of
    ``toolkit.trainer.placement.placement_facts``)."""
    micro = layout.micro_batch(local_batch, accumulation_steps)
    return {
        "backend": backend, "dtype": dtype, "precision": precision,
        "layout": layout.name, "layout_words": layout.describe(world_size, len(devices)),
        "world_size": world_size,
        "nodes": num_nodes or max(1, -(-world_size // max(1, local_size))),
        "ranks_per_node": local_size, "devices_per_rank": devices,
        "global_batch": global_batch, "local_batch": local_batch, "micro_batch": micro,
        "model": type(model).__name__, "parameters": parameter_count(model),
        "samples": samples, "steps_per_epoch": steps_per_epoch,
        "checkpoint_dir": None if checkpoint_dir is None else str(checkpoint_dir),
        "resumed_from": None if resumed_from is None else str(resumed_from),
        "start_step": resumed_step, "placement": placement,
    }


def format_facts(f: dict[str, Any]) -> str:
    """The start-up block (a few aligned lines)."""
    params = f"{f['parameters']:,} parameters" if f["parameters"] is not None else \
        "a native model"
    dtype = f", {f['dtype']}" if f["dtype"] else ""
    if f.get("precision", "").endswith("-mixed"):  # (the master parameters' dtype, then)
        dtype += f" parameters, {f['precision']}"
    if f["checkpoint_dir"] is None:
        ckpt = "none"
    elif f["resumed_from"] is None:
        ckpt = f"{f['checkpoint_dir']}: NEW RUN from step 0 (no checkpoint there to resume)"
    else:
        ckpt = (f"{f['checkpoint_dir']}: RESUMED at step {f['start_step']} from "
                f"{f['resumed_from']}")
    per_node = (f"{f['ranks_per_node']} per node"
                if f["nodes"] * f["ranks_per_node"] == f["world_size"] else
                f"{f['ranks_per_node']} on rank 0's node")  # (Slurm's block placement: 3 + 1)
    rows = [
        ("backend", f"{f['backend']}{dtype}"),
        ("layout", f["layout_words"]),
        ("world", f"{f['world_size']} rank(s) on {f['nodes']} node(s), {per_node}; devices "
                  f"per rank: {', '.join(f['devices_per_rank'])}"),
        *([("placement", "\n".join(format_placement(f["placement"], 12)))]
          if f.get("placement") else []),
        ("batch", f"global {f['global_batch']}, local {f['local_batch']} per data share, "
                  f"micro {f['micro_batch']}"),
        ("model", f"{f['model']}, {params}"),
        ("data", f"{f['samples']:,} samples, {f['steps_per_epoch']} steps per epoch"),
        ("checkpoints", ckpt),
        *([("mfu", f["mfu_words"])] if "mfu_words" in f else []),
    ]
    return "\n".join(f"{name:<12}{value}" for name, value in rows)
