"""Pipeline x ZeRO: what each ZeRO stage and each gather choice holds, moves and costs per step,
measured on 4 ranks (2 stages x 2 replicas sharding each stage) beside the pipeline alone.

    .venv/bin/python benchmarks/pipeline_zero.py
    .venv/bin/python benchmarks/pipeline_zero.py --micro-batches 8 --layers 8 --width 512

For each layout it launches ``mpirun -np 4`` on this script in worker mode (Horovod's MPI
controller: with ``horovodrun --gloo``, 4 ranks on a 2-core machine spent ten times as long in
each step's rounds, the pipeline alone as much as with ZeRO), which trains
``--steps`` steps of an untied GPT (AdamW) with the Trainer under ``pipeline:2:M`` and
``pipeline:2:M+sharded:Z`` (Z = 1, 2, 3; ZeRO-3 gathered once per step and per micro-batch),
and reports from every rank:

- the bytes held between steps (``adapter.memory_bytes()``: its real tensors);
- the most bytes the step's gathered parameters and full gradient sums held at once
  (``ShardedParameters.peak_transient``, from the live tensors), beside the formula: gathering
  once per step holds the stage's whole parameters (ZeRO-3) and its whole gradient sum
  (ZeRO-2/3) until the step's end; per micro-batch, about a unit at a time;
- the gathers and reduce-scatters per step (``ShardedParameters.collectives``);
- the median step time (the lowest of ``--repeats`` launches, the layouts in turn: this
  machine's noise only ever adds time).

The table shows the most loaded rank. A CPU figure is for the relative cost of the collectives
and of holding; on GPUs with a fast interconnect the gathers overlap less here than there.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
from _gpt import gpt_options, gpt_spec, launch_worker, save_every_rank, train_gpt

ZEROS = ("", "+sharded:1", "+sharded:2", "+sharded:3", "+sharded:3:gather=micro-batch")


def worker(args) -> None:
    """One run under mpirun: trains, then rank 0 writes every rank's figures."""
    import adapters

    adapter = adapters.get("horovod-torch")
    seconds = train_gpt(adapter, gpt_spec(args, tied=False), args.layout, args.batch,
                        args.steps)
    held = adapter.memory_bytes()
    shards = adapter.strategy.shards
    counts = shards.collectives if shards is not None else {}
    save_every_rank(adapter, [held["params"], held["grads"], held["optimizer"],
                              shards.peak_transient if shards is not None else 0,
                              counts.get("gather", 0) / args.steps,
                              counts.get("reduce_scatter", 0) / args.steps, seconds], args.out)


def launch(args, layout: str, out: Path) -> dict:
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    return launch_worker(["mpirun", *root, "--oversubscribe", "-np", "4"], __file__, args,
                         ["--layout", layout], out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--layouts", default=None,
                   help="comma-separated (default: the pipeline alone and with ZeRO 1, 2, 3 "
                        "gathered per step, 3 per micro-batch)")
    p.add_argument("--steps", type=int, default=5)
    gpt_options(p, context=64, batch=16, width=256)  # (--batch: the global batch)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--layout", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0

    from toolkit.memory import human

    spec = gpt_spec(args, tied=False)
    print(f"{spec!r}: {spec.num_params:,} parameters ({human(4 * spec.num_params)} float32); "
          f"AdamW; 4 ranks: 2 stages x 2 replicas, {args.micro_batches} micro-batches")
    print(f"{'layout':<44} {'params':>11} {'grads':>11} {'optimizer':>11} {'held':>11} "
          f"{'in-step':>11} {'gathers':>7} {'r-scat':>6} {'ms/step':>8} {'vs pipe':>7}")
    failed, base, results = False, None, {}
    with tempfile.TemporaryDirectory() as tmp:
        layouts = (args.layouts.split(",") if args.layouts else
                   [f"pipeline:2:{args.micro_batches}{zero}" for zero in ZEROS])
        for _ in range(args.repeats):
            for layout in layouts:
                out = Path(tmp) / "out.json"
                res = launch(args, layout, out)
                out.unlink(missing_ok=True)
                if "error" in res:
                    results[layout] = res
                    continue
                ranks = np.asarray(res["ranks"])
                if isinstance(results.get(layout), np.ndarray):
                    ranks[:, 6] = np.minimum(ranks[:, 6], results[layout][:, 6])
                results[layout] = ranks
    for layout, ranks in results.items():
        if isinstance(ranks, dict):
            print(f"{layout:<44} FAILED {ranks['error']}")
            failed = True
            continue
        worst = ranks[np.argmax(ranks[:, :3].sum(axis=1))]
        ms = float(np.median(ranks[:, 6])) * 1e3
        base = ms if "+" not in layout else base
        print(f"{layout:<44} {worst[0]:>11,.0f} {worst[1]:>11,.0f} {worst[2]:>11,.0f} "
              f"{worst[:3].sum():>11,.0f} {ranks[:, 3].max():>11,.0f} "
              f"{ranks[:, 4].max():>7.0f} {ranks[:, 5].max():>6.0f} {ms:>8.1f} "
              f"{(ms / base if base else float('nan')):>6.2f}x")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
