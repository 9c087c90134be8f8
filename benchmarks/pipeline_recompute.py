"""What a JAX pipeline keeps for its backward passes, and what recomputing instead costs.

    mpirun -np 2 .venv/bin/python benchmarks/pipeline_recompute.py --backend jax-pjit

S = 2 stages (one process each), a GPT cut between its blocks, ``--schedule`` over
``--micro-batches`` micro-batches. Without activation checkpointing each piece's forward hands
its micro-batch's backward the activations it needs (``adapters/_jax/residuals.py``), held
until that backward; with it, the backward runs the piece's forward again and nothing is held.
Per setting: the most bytes a stage held for its backward passes at once during a step
(``memory_bytes()["kept_for_backward"]``, from the arrays themselves; rank 0's stage), and the
median step time after ``--warmup`` steps, the settings alternating ``--repeats`` times.
Random tokens: the cost of a step does not depend on their values.
"""

import argparse
import statistics
import time

import numpy as np
from _gpt import gpt_options, gpt_spec

import adapters
import toolkit


def run(args, recompute: bool) -> tuple[list[float], int]:
    """The timed steps' seconds and the stage's most bytes kept for its backward passes."""
    adapter = adapters.get(args.backend)
    seconds, real_step = [], adapter.train_step

    def timed(x, y, lr):
        start = time.perf_counter()
        loss = real_step(x, y, lr)
        float(loss)  # wait for the step (JAX returns before its devices finish)
        seconds.append(time.perf_counter() - start)
        return loss

    adapter.train_step = timed
    spec = gpt_spec(args)
    tokens = np.random.default_rng(0).integers(0, 256, (args.batch * 4, args.context + 1))
    layout = f"pipeline:2:{args.micro_batches}:{args.schedule}"
    toolkit.Trainer(adapter, spec, toolkit.SGD(lr=1e-3), layout=layout, progress=False,
                    global_batch_size=args.batch, max_steps=args.warmup + args.steps,
                    activation_checkpointing=recompute).fit(tokens[:, :-1], tokens[:, 1:])
    return seconds[args.warmup:], adapter.memory_bytes()["kept_for_backward"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="jax-pjit", choices=("jax-pjit", "jax-pmap"))
    p.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b"))
    p.add_argument("--micro-batches", type=int, default=4)
    gpt_options(p, context=256, batch=16)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    times, kept = {False: [], True: []}, {}
    for _ in range(args.repeats):
        for recompute in (False, True):
            seconds, kept[recompute] = run(args, recompute)
            times[recompute] += seconds
    toolkit.print0(f"{args.backend}: S = 2, {args.schedule}, M = {args.micro_batches}, GPT "
                   f"{args.layers} blocks, width {args.width}, {args.heads} heads, batch "
                   f"{args.batch} x {args.context} tokens, float32")
    toolkit.print0(f"{'recompute':10s} {'kept for backward (stage 0)':>28s} {'step ms':>9s}")
    for recompute in (False, True):
        toolkit.print0(f"{'yes' if recompute else 'no':10s} {kept[recompute]:>28,} "
                       f"{statistics.median(times[recompute]) * 1e3:>9.1f}")
    ratio = statistics.median(times[True]) / statistics.median(times[False])
    toolkit.print0(f"recomputing takes {ratio:.2f}x the step time of keeping")


if __name__ == "__main__":
    main()
