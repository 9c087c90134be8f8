"""A training job in which one rank fails mid-training (for the failure and stall tests).

CRASH_RANK: the rank that fails; CRASH_STEP: at which of its steps; CRASH_MODE: ``raise``
(an exception), ``kill`` (SIGKILL, as a dying node would), ``stop`` (SIGSTOP: a process that
stops answering, as one swapped out or stopped by a debugger) or ``hang`` (its data set's
``batch`` never returns, as on a hung file system). The other ranks are then waiting in an
allreduce: the job must still end, non-zero, instead of hanging. CHECKPOINT_DIR: where
checkpoints go every 2 steps (the last good one must survive the crash); STALL_TIMEOUT: the
Trainer's ``stall_timeout``; METRICS_LOG: its metrics log.
"""

import os
import signal
import threading

import numpy as np

import adapters
import toolkit
from toolkit.datasets import load_digits


class HangingDigits:
    """The digits, whose ``batch`` blocks forever at its ``at``-th call on rank ``rank``."""

    def __init__(self, x, y, at: int, hang: bool):
        self.data, self.calls, self.at, self.hang = toolkit.ArrayDataset(x, y), 0, at, hang

    def __len__(self):
        return len(self.data)

    def batch(self, indices: np.ndarray):
        self.calls += 1
        if self.hang and self.calls == self.at:
            threading.Event().wait()
        return self.data.batch(indices)


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
            if mode in ("kill", "stop"):
                os.kill(os.getpid(), signal.SIGKILL if mode == "kill" else signal.SIGSTOP)
            if mode == "raise":
                raise RuntimeError(f"injected failure on rank {rank}")
        return real_step(xb, yb, lr)

    adapter.train_step = train_step
    data = HangingDigits(x, y, crash_step, mode == "hang" and rank == crash_rank)
    toolkit.Trainer(adapter, toolkit.MLP((64, 32, 10)), toolkit.SGD(lr=0.1),
                    global_batch_size=32, max_steps=10_000, prefetch=False,
                    stall_timeout=float(os.environ.get("STALL_TIMEOUT", "600")),
                    metrics_log=os.environ.get("METRICS_LOG"),
                    checkpoint_dir=os.environ.get("CHECKPOINT_DIR"), checkpoint_every=2).fit(data)


if __name__ == "__main__":
    toolkit.run(main)
