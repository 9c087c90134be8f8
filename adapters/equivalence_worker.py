"""One run of the equivalence check (started by ``python -m adapters.equivalence``).

Trains the chosen presets with the Trainer, then rank 0 writes ``result.json`` (per-step
losses averaged across ranks, median step time) and ``params.npz`` (final parameters) into
``--out``. A backend whose framework is not installed writes status ``skipped`` and its reason.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

import adapters
import toolkit
from adapters._common import float32_matmuls
from adapters._horovod.runtime import layout_groups
from toolkit.equivalence import load_data, make_model, make_optimizer
from toolkit.launch.devices import count_gpus


def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("--backend", "--model", "--optimizer", "--dtype", "--out", "--layout"):
        p.add_argument(name, required=True)
    for name in ("--steps", "--batch-size", "--seed"):
        p.add_argument(name, type=int, required=True)
    p.add_argument("--local-devices", type=int, default=None)
    p.add_argument("--clip-grad-norm", type=float, default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--precision", default=None)
    args = p.parse_args()
    env = toolkit.current_env()
    # Several layouts (comma-separated) run one after the other in the same processes, each
    # with a fresh adapter: one launch instead of one per layout. Results go to OUT/<i>/. The
    # layouts with process sets run first: Horovod makes them when it starts.
    layouts = [toolkit.parse_layout(name) for name in args.layout.split(",")]
    # Horovod registers the first layout's process sets as it starts (a pipeline's stage
    # replicas, a composition's shard and replica groups); layouts that reduce in other rank
    # groups add theirs later, which Horovod allows only with dynamic process sets, asked for
    # before it starts.
    groups = {}
    for layout in layouts:
        try:
            groups[layout] = layout_groups(layout, env.world_size)
        except toolkit.ToolkitError:  # (a layout that does not fit: its run says so)
            groups[layout] = ()
    if len(set(groups.values()) - {()}) > 1:
        os.environ.setdefault("HOROVOD_DYNAMIC_PROCESS_SETS", "1")
    for i, layout in sorted(enumerate(layouts), key=lambda item: not groups[item[1]]):
        run_layout(args, layout, Path(args.out) / str(i), env)


def run_layout(args, layout, out: Path, env) -> None:
    adapter = adapters.get(args.backend, dtype=args.dtype, precision=args.precision,
                           local_devices=args.local_devices)
    if layout.kind not in adapter.layouts:
        toolkit.save0(out / "result.json", json.dumps({
            "status": "skipped", "reason": f"{args.backend} cannot run {layout.name} yet"}),
            env=env)
        return
    try:
        adapter.setup(env, layout, args.device)  # (Horovod registers the layout's process
        # sets as it starts)
        if args.device != "cpu" and count_gpus():  # (the framework is importable by now)
            # the reference's float32 (TensorFloat-32 keeps 10 mantissa bits: 1e-3 relative)
            float32_matmuls(args.backend, tf32=False)
    except toolkit.ToolkitError as err:
        if "not importable" in str(err):
            toolkit.save0(out / "result.json", json.dumps({"status": "skipped",
                                                           "reason": err.message}), env=env)
            return
        raise
    step_seconds = []
    real_step = adapter.train_step

    def timed_step(x, y, lr):
        start = time.perf_counter()
        loss = real_step(x, y, lr)
        float(loss)  # the step's time includes its computation (JAX returns before it ends)
        step_seconds.append(time.perf_counter() - start)
        return loss

    adapter.train_step = timed_step
    x, y = load_data(args.model, args.dtype)
    trainer = toolkit.Trainer(adapter, make_model(args.model),
                              make_optimizer(args.optimizer, args.steps),
                              global_batch_size=args.batch_size, max_steps=args.steps,
                              seed=args.seed, progress=False, layout=layout, env=env,
                              clip_grad_norm=args.clip_grad_norm, device=args.device)
    try:
        history = trainer.fit(x, y)
    except toolkit.ToolkitError as err:  # said in the table, never a silent pass
        if "does not clip gradients" not in str(err) and "does not run precision" not in str(err):
            raise
        toolkit.save0(out / "result.json", json.dumps({"status": "skipped",
                                                       "reason": err.message}), env=env)
        return
    params = {k[len("params/"):]: v for k, v in adapter.state_dict().items()
              if k.startswith("params/")}
    # Median over steps after the first few, which include compilation.
    median = float(np.median(step_seconds[min(5, len(step_seconds) - 1):]))
    step_time = float(adapter.allreduce(np.asarray([median]), "mean")[0])
    toolkit.save0(out / "params.npz", lambda f: np.savez(f, **params), env=env)
    extra = {}
    if isinstance(layout, toolkit.Sharded | toolkit.Pipeline):  # counted by the backend
        held = adapter.memory_bytes()
    else:  # replicated: every rank holds all parameters, a gradient each, all optimizer state
        state = adapter.state_dict()
        params = sum(v.nbytes for k, v in state.items() if k.startswith("params/"))
        held = {"params": params, "grads": params,
                "optimizer": sum(v.nbytes for k, v in state.items() if k.startswith("opt/"))}
    if isinstance(layout, toolkit.Pipeline):  # each stage's bytes (its replica 0's rank)
        stage, replica = adapter.pipeline_position()
        mine = np.zeros(layout.stages)
        mine[stage] = float(sum(held.values())) if replica == 0 else 0.0
        extra["stage_bytes"] = [float(b) for b in adapter.allreduce(mine, "sum")]
    state_bytes = adapter.allreduce(np.asarray([float(sum(held.values()))]), "mean")[0]
    toolkit.save0(out / "result.json", json.dumps({
        "status": "ok", "losses": history.losses, "grad_norms": history.grad_norms,
        "step_seconds": step_time,
        "world_size": env.world_size, "state_bytes_per_rank": float(state_bytes),
        # (ranks, devices per rank) each global batch is split over: the bf16-mixed
        # reference splits it so
        "data_split": list(adapter.strategy.data_split),
        "part_weight": adapter.strategy.part_weight,
        "device": ",".join(adapter.device_names()), **extra}),
        env=env)


if __name__ == "__main__":
    toolkit.run(main)
