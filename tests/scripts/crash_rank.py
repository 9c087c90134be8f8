"""A training job in which one rank fails mid-training (for the failure tests).

CRASH_RANK: the rank that fails; CRASH_STEP: at which of its steps; CRASH_MODE: ``raise``
(an exception) or ``kill`` (SIGKILL, as a dying node would). The other ranks are then waiting in
an allreduce: the job must still end, non-zero, instead of hanging. CHECKPOINT_DIR: where
checkpoints go every 2 steps (the last good one must survive the crash).
"""

import os
import signal

import adapters
import toolkit
from toolkit.datasets import load_digits


def main() -> None:
    (x, y), _ = load_digits()
    adapter = adapters.get(os.environ.get("BACKEND", "horovod-torch"))
    rank = toolkit.current_env().rank
    crash_rank = int(os.environ.get("CRASH_RANK", "1"))
    crash_step = int(os.environ.get("CRASH_STEP", "5"))
    mode = os.environ.get("CRASH_MODE", "raise")
    real_step, steps = adapter.train_step, [0]

    def train_step(xb, yb, lr):
        steps[0] += 1
        if rank == crash_rank and steps[0] == crash_step:
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"injected failure on rank {rank}")
        return real_step(xb, yb, lr)

    adapter.train_step = train_step
    toolkit.Trainer(adapter, toolkit.MLP((64, 32, 10)), toolkit.SGD(lr=0.1),
                    global_batch_size=32, max_steps=10_000,
                    checkpoint_dir=os.environ.get("CHECKPOINT_DIR"), checkpoint_every=2).fit(x, y)


if __name__ == "__main__":
    toolkit.run(main)
