"""What BatchPrefetcher.stats() measures: two clocks, the loading and training's wait."""

import time

import numpy as np
import pytest

from toolkit.data.prefetch import BatchPrefetcher
from toolkit.data.sampler import GlobalBatchSampler

BATCHES = 6


class Slow:
    """A dataset whose batch takes ``seconds``."""

    def __init__(self, seconds):
        self.seconds = seconds

    def __len__(self):
        return 64

    def batch(self, indices):
        time.sleep(self.seconds)
        return np.asarray(indices, dtype=np.float32), np.asarray(indices)


def train(dataset, step, prefetch=True):
    sampler = GlobalBatchSampler(len(dataset), 8, shuffle=False)
    with BatchPrefetcher(dataset, sampler, BATCHES, prefetch=prefetch) as loader:
        for made, indices in enumerate(sampler, 1):
            x, _ = loader.get(indices)
            np.testing.assert_array_equal(x, indices)
            step()
            if made == BATCHES:
                break
    stats = loader.stats()
    assert stats["batches"] == BATCHES and stats["prefetch"] is prefetch
    return stats


def test_without_the_thread_training_waits_for_exactly_the_loading():
    stats = train(Slow(0.01), lambda: None, prefetch=False)
    assert stats["wait_seconds"] == stats["load_seconds"] >= BATCHES * 0.01
    assert stats["hidden_fraction"] == 0.0


def test_the_threads_loading_counts_though_hidden_and_its_hand_over_waits_do_not():
    """Loading 0.02 s behind a 0.06 s step: all of it is loading time, though training waits
    only for the first batch; the thread's time blocked with a batch ready (0.04 s a step)
    is not loading."""
    stats = train(Slow(0.02), lambda: time.sleep(0.06))
    assert BATCHES * 0.02 <= stats["load_seconds"] < BATCHES * 0.02 + 0.1
    assert stats["wait_seconds"] < 0.5 * stats["load_seconds"]
    assert stats["hidden_fraction"] > 0.5


def test_training_waits_for_the_loading_a_quick_step_cannot_hide():
    stats = train(Slow(0.03), lambda: None)
    assert stats["load_seconds"] >= BATCHES * 0.03
    assert stats["wait_seconds"] >= 0.5 * stats["load_seconds"]


@pytest.mark.parametrize("prefetch", [True, False])
def test_stats_before_any_batch(prefetch):
    sampler = GlobalBatchSampler(64, 8, shuffle=False)
    with BatchPrefetcher(Slow(0), sampler, 0, prefetch=prefetch) as loader:
        pass
    assert loader.stats() == {"prefetch": False, "batches": 0, "load_seconds": 0.0,
                              "wait_seconds": 0.0, "hidden_fraction": 0.0}
