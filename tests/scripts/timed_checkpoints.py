"""Checkpoints every ``--seconds`` of training on ranks whose clocks disagree: the last rank
sleeps ``--lag`` seconds in every step, so each rank alone would find a checkpoint due at
other steps. Every rank writes its own pieces (a sharded layout), so ranks that disagreed
would wait in different collectives.

    mpirun -np 2 python tests/scripts/timed_checkpoints.py --checkpoint-dir DIR
"""

import argparse
import time

import adapters
import toolkit
from toolkit.datasets import load_digits


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seconds", type=float, default=0.05)
    p.add_argument("--lag", type=float, default=0.02)
    args = p.parse_args()
    env = toolkit.current_env()
    adapter = adapters.get("horovod-torch")
    if env.rank == env.world_size - 1:
        real_step = adapter.train_step

        def slow_step(x, y, lr):
            time.sleep(args.lag)
            return real_step(x, y, lr)

        adapter.train_step = slow_step
    (x, y), _ = load_digits()
    toolkit.Trainer(adapter, toolkit.MLP((64, 32, 10)), toolkit.SGD(lr=0.05),
                    global_batch_size=64, max_steps=args.steps, layout="sharded:2",
                    checkpoint_dir=args.checkpoint_dir, checkpoint_every_seconds=args.seconds,
                    keep=1000, progress=False, env=env).fit(x, y)


if __name__ == "__main__":
    toolkit.run(main)
