"""Per-rank training-state bytes of each layout, measured from the tensors each rank holds,
beside ``python -m toolkit.memory``'s prediction, and step time relative to data parallel.

    .venv/bin/python benchmarks/sharded_memory.py                       # every backend, N = 2, 4
    .venv/bin/python benchmarks/sharded_memory.py --backends horovod-torch --world-sizes 2

For every backend, world size N and layout (data parallel, ZeRO stages 1-3) it launches
``horovodrun -np N`` on this script in worker mode, which trains ``--steps`` steps of a GPT of a
few million parameters (AdamW) with the Trainer and reports, from every rank, the bytes the
backend holds for parameters, gradients and optimizer state (``adapter.memory_bytes()``: the
sizes of its real tensors; for data parallel, the full state's sizes) and the median step time.
The table shows the most loaded rank, the estimator's figure, and for stage 3 the issue's goal:
per-rank bytes <= 1.05 x (replicated bytes / N) + one unit's gathered parameters.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
from _gpt import gpt_options, gpt_spec, launch_worker, save_every_rank, train_gpt

BACKENDS = ("horovod-torch", "horovod-tf", "jax-pmap", "jax-pjit")
LAYOUTS = ("data", "sharded:1", "sharded:2", "sharded:3")


def worker(args) -> None:
    """One run under a launcher: trains, then rank 0 writes every rank's bytes and times."""
    import adapters
    import toolkit

    adapter = adapters.get(args.backend)
    layout = toolkit.parse_layout(args.layout)
    seconds = train_gpt(adapter, gpt_spec(args), layout, args.batch, args.steps)
    if isinstance(layout, toolkit.Sharded):
        held = adapter.memory_bytes()
    else:
        state = adapter.state_dict()
        params = sum(v.nbytes for k, v in state.items() if k.startswith("params/"))
        held = {"params": params, "grads": params,
                "optimizer": sum(v.nbytes for k, v in state.items() if k.startswith("opt/"))}
    save_every_rank(adapter, [held["params"], held["grads"], held["optimizer"], seconds],
                    args.out)


def launch(args, backend: str, world: int, layout: str, out: Path) -> dict:
    horovodrun = str(Path(sys.executable).parent / "horovodrun")
    return launch_worker([] if world == 1 else [horovodrun, "-np", str(world), "--gloo"],
                         __file__, args, ["--backend", backend, "--layout", layout], out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--world-sizes", default="2,4")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--steps", type=int, default=4)
    gpt_options(p, context=64, batch=8, width=256)  # (--batch: the global batch)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--backend", help=argparse.SUPPRESS)
    p.add_argument("--layout", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0

    from toolkit import parse_layout
    from toolkit.memory import estimate, human
    from toolkit.parallel.shards import unit_layouts

    spec = gpt_spec(args)
    arrays = spec.init(0, "float32")
    replicated = 4 * spec.num_params * 4  # params, grads, Adam's two moments (float32)
    units = unit_layouts({k: v.shape for k, v in arrays.items()}, 1)
    largest_unit = max(4 * u.total for u in units.values())
    print(f"{spec!r}: {spec.num_params:,} parameters; AdamW; replicated state "
          f"{human(replicated)} per rank; largest unit {human(largest_unit)}")
    header = (f"{'backend':<14} {'N':>2} {'layout':<10} {'params':>12} {'grads':>12} "
              f"{'optimizer':>12} {'total':>12} {'estimator':>12} {'vs est':>7} "
              f"{'ms/step':>8} {'vs data':>7}  goal")
    print(header)
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        for backend in args.backends.split(","):
            for world in (int(w) for w in args.world_sizes.split(",")):
                base_ms = None
                for layout in args.layouts.split(","):
                    res = launch(args, backend, world, layout, Path(tmp) / "out.json")
                    (Path(tmp) / "out.json").unlink(missing_ok=True)
                    if "error" in res:
                        print(f"{backend:<14} {world:>2} {layout:<10} FAILED {res['error']}")
                        failed = True
                        continue
                    ranks = np.asarray(res["ranks"])
                    worst = ranks[np.argmax(ranks[:, :3].sum(axis=1))]
                    total = worst[:3].sum()
                    ms = float(np.median(ranks[:, 3])) * 1e3
                    base_ms = ms if layout == "data" else base_ms
                    est = estimate(spec.num_params, parse_layout(layout), world).model_states
                    goal = ""
                    if layout == "sharded:3":
                        ok = total <= 1.05 * replicated / world + largest_unit
                        goal = "met" if ok else "MISSED"
                        failed |= not ok
                    print(f"{backend:<14} {world:>2} {layout:<10} {worst[0]:>12,.0f} "
                          f"{worst[1]:>12,.0f} {worst[2]:>12,.0f} {total:>12,.0f} "
                          f"{est:>12,.0f} {total / est:>7.3f} {ms:>8.1f} "
                          f"{(ms / base_ms if base_ms else float('nan')):>6.2f}x  {goal}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
