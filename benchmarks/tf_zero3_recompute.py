"""What horovod-tf's ZeRO-3 pays for recomputing: a GPT trained by the Trainer under
``sharded:3`` on one process, with ``activation_checkpointing`` left to the layout (each unit's
backward gathers its parameters again and recomputes its forward) and with ``False`` (each
unit's forward tape, and with it its gathered parameters, kept until its backward).

    .venv/bin/python benchmarks/tf_zero3_recompute.py --context 512 --batch 4

Windows of ``--steps`` steps of each setting alternate (``_paired.paired_windows``); it prints
the median time per step of each and the median of the per-window ratios.
"""

import argparse
import statistics
import time

import numpy as np
from _gpt import gpt_options, gpt_spec
from _paired import paired_windows

import adapters
import toolkit
from toolkit.equivalence import stdlib_bytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    gpt_options(p, context=512, batch=4)
    p.add_argument("--steps", type=int, default=5, help="steps per window")
    p.add_argument("--windows", type=int, default=6)
    args = p.parse_args()
    spec = gpt_spec(args)
    n = args.batch * 8
    tokens = stdlib_bytes(n * spec.context + 1).astype(np.int64)
    x, y = tokens[:-1].reshape(n, spec.context), tokens[1:].reshape(n, spec.context)
    trainers = {}
    for recompute in (None, False):
        trainers[recompute] = toolkit.Trainer(
            adapters.get("horovod-tf"), spec, toolkit.Adam(lr=1e-3), layout="sharded:3",
            global_batch_size=args.batch, max_steps=2, seed=0, progress=False,
            stop_signals=(), activation_checkpointing=recompute)
        trainers[recompute].fit(x, y)  # compiled and warmed up

    def window(recompute):
        def run() -> float:
            trainer = trainers[recompute]
            start = time.perf_counter()
            trainer.max_steps += args.steps
            trainer.fit(x, y)
            return time.perf_counter() - start
        return run

    again, kept, ratio = paired_windows(window(None), window(False), args.windows)
    print(f"horovod-tf sharded:3, 1 process: GPT {spec.num_params:,} parameters, {args.layers} "
          f"blocks, width {args.width}, {args.heads} heads, batch {args.batch} x "
          f"{args.context} tokens, float32, Adam")
    print(f"{'activation_checkpointing':26s} {'ms/step':>8s}")
    for name, times in (("None (recomputes)", again), ("False (keeps the tape)", kept)):
        print(f"{name:26s} {statistics.median(times) / args.steps * 1e3:>8.1f}")
    print(f"recomputing takes {ratio:.2f}x the time of keeping the tape (median of "
          f"{args.windows} paired windows)")


if __name__ == "__main__":
    main()
