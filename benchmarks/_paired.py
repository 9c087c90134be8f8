"""Paired timing windows: two ways of doing the same work, measured side by side."""

import statistics
from collections.abc import Callable


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
