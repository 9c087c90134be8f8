"""Bytes that cross the link between the two nodes per training step, for ZeRO-3 over all four
ranks against HSDP (ZeRO-3 inside each node, the two nodes' shards averaged across the link),
measured on the link itself beside what the ring formula predicts.

    .venv/bin/python benchmarks/node_link_bytes.py                       # as root
    .venv/bin/python benchmarks/node_link_bytes.py --backends horovod-torch --short 1 --long 3

It starts the local two-node cluster (``slurm/local_cluster.sh start --nodes 2``: node1 and
node2 are network namespaces joined by a bridge, each behind a veth whose host end is
``tkv1``/``tkv2``) and, for each backend and layout, trains ``examples/train_gpt.py`` with
``srun -N 2 --ntasks-per-node=2`` twice, ``--short`` and ``--long`` steps. The bytes node1's
veth sent and received during each run (``/sys/class/net/tkv1/statistics``) include the start,
the rendezvous and the final evaluation, which both runs share: their difference over the
extra steps is the bytes one step moves across the link.

The prediction, for ``P`` bytes of parameters and ring collectives over a rank order that
crosses the link twice (ranks 0,1 on node1, 2,3 on node2): ZeRO-3 over 4 ranks gathers the
parameters twice (forward, and again for the backward) and reduce-scatters the gradient, each
ring carrying ``3/4 P`` over each of its 2 crossing edges: ``3 x 2 x 3/4 P = 4.5 P``. HSDP
gathers and reduce-scatters inside a node and all-reduces each rank's ``P/2`` shard with its
replica on the other node (a 2-rank ring: ``P/2`` each way per pair, 2 pairs): ``2 P``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "slurm" / "local_cluster.sh"
LAYOUTS = ("sharded:3", "sharded:3+replicate:2")
FORMULA = {"sharded:3": 4.5, "sharded:3+replicate:2": 2.0}  # x P per step, both directions


def link_bytes() -> int:
    stats = Path("/sys/class/net/tkv1/statistics")
    return sum(int((stats / f).read_text()) for f in ("rx_bytes", "tx_bytes"))


def train(env: dict, backend: str, layout: str, steps: int, args) -> tuple[int, str]:
    cmd = ["srun", "-N", "2", "--ntasks-per-node=2", "--mpi=pmix", "--kill-on-bad-exit=1",
           sys.executable, "examples/train_gpt.py", "--backend", backend, "--layout", layout,
           "--steps", str(steps), "--batch-size", "8", "--layers", str(args.layers),
           "--width", str(args.width), "--context", "32", "--eval-every", "100000",
           "--eval-windows", "8", "--final-eval-windows", "8", "--sample-bytes", "0"]
    before = link_bytes()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=args.timeout)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return link_bytes() - before, proc.stdout


def param_bytes(args) -> int:
    sys.path.insert(0, str(ROOT))
    import toolkit

    spec = toolkit.GPT(vocab=256, context=32, width=args.width, layers=args.layers,
                       heads=max(1, args.width // 64))
    return sum(a.size for a in spec.init(0).values()) * 4  # float32


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/node_link_bytes.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="horovod-torch,horovod-tf,jax-pmap,jax-pjit")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="separated by ;")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--short", type=int, default=2)
    p.add_argument("--long", type=int, default=6)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("the two-node cluster makes network namespaces: run as root")
    running = Path("/sys/class/net/tkv1").exists()  # (left running if it was)
    started = subprocess.run([str(CLUSTER), "start", "--nodes", "2"], capture_output=True,
                             text=True, timeout=120)
    if started.returncode:
        raise SystemExit(started.stderr)
    env = {**os.environ, "SLURM_CONF": started.stdout.strip().rpartition("=")[2],
           "PYTHONUNBUFFERED": "1"}
    try:
        return measure(args, env)
    finally:
        if not running:
            subprocess.run([str(CLUSTER), "stop", "--nodes", "2"], capture_output=True,
                           timeout=120)


def measure(args, env: dict) -> int:
    P = param_bytes(args)
    rows = []
    print(f"GPT of {P / 4:,.0f} parameters (P = {P / 1e6:.2f} MB in float32), 2 nodes x 2 "
          f"ranks; bytes per step crossing the link = (run of {args.long} steps - run of "
          f"{args.short}) / {args.long - args.short}, both directions")
    print(f"{'backend':<14} {'layout':<24} {'MB/step':>9} {'x P':>6} {'ring formula':>13}")
    for backend in args.backends.split(","):
        for layout in args.layouts.replace(";", ",").split(","):
            short, out = train(env, backend, layout, args.short, args)
            long_, _ = train(env, backend, layout, args.long, args)
            per_step = (long_ - short) / (args.long - args.short)
            formula = FORMULA.get(layout)
            rows.append({"backend": backend, "layout": layout, "bytes_per_step": per_step,
                         "param_bytes": P, "formula_x_P": formula})
            print(f"{backend:<14} {layout:<24} {per_step / 1e6:9.2f} {per_step / P:6.2f} "
                  f"{'' if formula is None else f'{formula:.1f} P':>13}", flush=True)
            placement = out[out.find("\nplacement") + 1:].splitlines()[:2]
            print("\n".join(f"    {line}" for line in placement if line.strip()), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
