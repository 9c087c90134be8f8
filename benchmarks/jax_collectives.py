"""Where jax-pjit's sharded step spends its time across processes: the collectives in its
compiled program, its step time beside jax-pmap's, and what one combined all-reduce costs.

    mpirun -np 2 .venv/bin/python benchmarks/jax_collectives.py --local-devices 2

1. For each layout, builds the equivalence preset GPT (2 blocks, width 32) under jax-pjit and
   jax-pmap, trains ``--steps`` steps and prints the median step time (after ``--warmup``
   warm-up steps); for jax-pjit, also the collectives of its compiled step (with their
   operand count), counted in the optimised HLO that XLA writes when asked to
   (``XLA_FLAGS=--xla_dump_to=...``): the largest program compiled while the adapter trained.
2. Times a jitted gradient of 30 small matrices over a batch sharded across every device (the
   compiler combines their 30 all-reduces into one op of 30 operands) beside the same with one
   matrix: on XLA:CPU the combined op costs about 30 times the single one, because its
   operands are reduced one after another over Gloo.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
from _paired import time_steps

import adapters
import toolkit
from toolkit.equivalence import load_data, make_model, make_optimizer

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")


def collectives(hlo: str) -> dict[str, str]:
    """The collective ops a compiled program's text holds, by kind: how many, and how many
    operands they carry in all (``all-reduce(%a, %b, ...)`` is one op of two operands)."""
    found = re.findall(r" (" + "|".join(COLLECTIVES) + r")(?:-start)?\(([^)]*)\)", hlo)
    ops, operands = Counter(), Counter()
    for kind, args in found:
        ops[kind] += 1
        operands[kind] += args.count("%")
    return {kind: f"{n} op(s), {operands[kind]} operand(s)" for kind, n in ops.items()}


class CompiledPrograms:
    """The optimised HLO of every program this process compiles, as XLA itself writes it
    (``--xla_dump_to``); set up before JAX starts its backend."""

    def __init__(self):
        self.folder = Path(tempfile.mkdtemp(prefix="jax-collectives-hlo-"))
        os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} "
                                   f"--xla_dump_to={self.folder} --xla_dump_hlo_as_text").strip()

    def written(self) -> set[Path]:
        return set(self.folder.glob("*after_optimizations.txt"))

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def train(backend: str, layout: str, args, env,
          programs: CompiledPrograms) -> tuple[float, dict[str, str] | None]:
    adapter = adapters.get(backend, local_devices=args.local_devices)
    x, y = load_data("gpt", "float32")
    trainer = toolkit.Trainer(adapter, make_model("gpt"), make_optimizer("sgd", args.steps),
                              global_batch_size=64, max_steps=args.steps, progress=False,
                              layout=layout, env=env)
    seconds = time_steps(adapter)
    before = programs.written()
    trainer.fit(x, y)
    ops = None
    if backend == "jax-pjit":
        # The training step is by far the largest program compiled during fit (forward,
        # backward, the optimizer); the others place arrays or reduce host values.
        step = max(programs.written() - before, key=lambda path: path.stat().st_size)
        ops = collectives(step.read_text())
    median = statistics.median(seconds[args.warmup:])
    return float(adapter.allreduce(np.asarray([median]), "mean")[0]), ops


def combined_all_reduce(env, local_devices: int | None, repeats: int) -> dict[int, float]:
    adapter = adapters.get("jax-pjit", local_devices=local_devices)
    adapter.setup(env)
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.asarray(devices), ("data",))
    batch = jax.make_array_from_callback(
        (64 * len(devices), 32), NamedSharding(mesh, PartitionSpec("data")),
        lambda index: np.ones((64, 32), np.float32))
    out = {}
    for count in (1, 30):
        weights = [np.ones((32, 32), np.float32) for _ in range(count)]
        grad = jax.jit(lambda ws, xb: jax.grad(
            lambda ws: sum(jnp.sum(xb @ w) for w in ws))(ws),
            out_shardings=NamedSharding(mesh, PartitionSpec()))
        jax.block_until_ready(grad(weights, batch))
        start = time.perf_counter()
        for _ in range(repeats):
            jax.block_until_ready(grad(weights, batch))
        out[count] = (time.perf_counter() - start) / repeats
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--local-devices", type=int, default=None, help="JAX CPU devices each")
    p.add_argument("--layouts", default="data,sharded:3", help="comma-separated")
    p.add_argument("--steps", type=int, default=30, help="training steps per layout and backend")
    p.add_argument("--warmup", type=int, default=5, help="first steps not timed")
    p.add_argument("--repeats", type=int, default=20, help="timed calls of each all-reduce")
    args = p.parse_args()
    if args.steps <= args.warmup:
        raise toolkit.ToolkitError(f"--steps {args.steps} leaves no step after --warmup "
                                   f"{args.warmup}", "give more steps than warm-up steps")
    programs = CompiledPrograms()
    env = toolkit.current_env()
    devices = args.local_devices or 1
    toolkit.print0(f"{env.world_size} process(es) x {devices} device(s); GPT preset, batch 64",
                   env=env)
    try:
        for layout in args.layouts.split(","):
            pjit, ops = train("jax-pjit", layout, args, env, programs)
            pmap, _ = train("jax-pmap", layout, args, env, programs)
            toolkit.print0(f"{layout:12s} jax-pjit {pjit * 1e3:8.2f} ms/step  jax-pmap "
                           f"{pmap * 1e3:8.2f} ms/step  ratio {pjit / pmap:5.2f}  "
                           f"jax-pjit's collectives: {ops}", env=env)
        times = combined_all_reduce(env, args.local_devices, args.repeats)
        toolkit.print0(f"gradient all-reduce of 1 matrix {times[1] * 1e3:.2f} ms; of 30 "
                       f"matrices (one combined op) {times[30] * 1e3:.2f} ms", env=env)
    finally:
        programs.close()


if __name__ == "__main__":
    toolkit.run(main)
