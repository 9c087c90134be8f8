"""The Trainer against a hand-written loop, in paired timing windows (shared by
``step_overhead.py`` and ``gpt_throughput.py``)."""

import statistics
import time
from collections.abc import Callable, Iterator

import numpy as np


def local_batches(x, y, batch: int, env, seed: int) -> Iterator[tuple]:
    """Rank r's strided part of each global batch of shuffled passes, forever."""
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(len(x))
        for start in range(0, len(x) - batch + 1, batch):
            idx = order[start:start + batch][env.rank::env.world_size]
            yield x[idx], y[idx]


def paired_windows(first: Callable[[], float], second: Callable[[], float],
                   windows: int) -> tuple[list[float], list[float], float]:
    """Runs ``first`` and ``second`` (each returns its window's seconds) ``windows`` times,
    alternating which goes first so drift on a noisy machine hits both alike. Returns both
    lists of seconds and the median of the per-window ratios first / second."""
    a, b = [], []
    for w in range(windows):
        if w % 2:
            b.append(second())
            a.append(first())
        else:
            a.append(first())
            b.append(second())
    return a, b, statistics.median(x / y for x, y in zip(a, b, strict=True))


def trainer_against_hand(trainer, hand, sync, x, y, env, *, steps: int, windows: int,
                         seed: int) -> tuple[list[float], list[float], float]:
    """Windows of ``steps`` steps: ``trainer.fit`` (set up and warmed already) against
    ``hand(x_local, y_local)`` on this rank's batches (warmed up here), each window waiting for
    its last step; ``sync()`` waits for the hand loop's state. :func:`paired_windows`' result."""
    batches = local_batches(x, y, trainer.global_batch_size, env, seed)
    for _ in range(3):  # the hand loop's warm-up (compilation)
        hand(*next(batches))
    sync()

    def run_toolkit() -> float:
        start = time.perf_counter()
        trainer.max_steps += steps
        trainer.fit(x, y)
        return time.perf_counter() - start

    def run_hand() -> float:
        start = time.perf_counter()
        for _ in range(steps):
            loss = hand(*next(batches))
        float(np.mean(np.asarray(loss)))  # wait for the last step, as the Trainer does
        sync()
        return time.perf_counter() - start

    return paired_windows(run_toolkit, run_hand, windows)


def time_steps(adapter) -> list[float]:
    """Wraps ``adapter.train_step`` to time each step to the end of its computation (the loss
    is converted: JAX returns before it ends); returns the list the times go to."""
    times: list[float] = []
    real_step = adapter.train_step

    def timed(xb, yb, lr):
        start = time.perf_counter()
        loss = real_step(xb, yb, lr)
        float(loss)
        times.append(time.perf_counter() - start)
        return loss

    adapter.train_step = timed
    return times

