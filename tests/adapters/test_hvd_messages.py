"""The Horovod pipeline executors' message plumbing, framework-free: how a round's messages
are packed into one alltoall buffer, the order horovod-tf submits its rounds in, and the
thread that keeps a waiting stage's core busy."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from adapters._horovod.rounds import ALIGNMENT, pack, unpack
from adapters.horovod_tf.pipeline import InOrderRounds, Spinner


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_pack_puts_each_ranks_arrays_in_rank_order_and_unpack_reads_them_back(dtype):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((3, 4)), rng.standard_normal(5).astype(np.float32)
    c = rng.standard_normal((2, 1, 3))
    buf, splits = pack({2: [c], 0: [a, b]}, 4, dtype)
    assert buf.dtype == dtype and buf.ctypes.data % ALIGNMENT == 0
    assert splits == [(1 + 2 + 12) + (1 + 1 + 5), 0, 1 + 3 + 6, 0]
    first, offset = unpack(buf[:splits[0]], 0)
    second, end = unpack(buf[:splits[0]], offset)
    third, _ = unpack(buf[splits[0]:], 0)
    assert end == splits[0]
    for got, want in ((first, a), (second, b), (third, c)):
        assert got.shape == want.shape and got.dtype == dtype
        np.testing.assert_array_equal(got, want.astype(dtype))


def test_pack_of_nothing_is_an_empty_buffer_with_zero_splits():
    buf, splits = pack({}, 3, np.float32)
    assert buf.size == 0 and splits == [0, 0, 0]


def test_rounds_are_submitted_in_round_order_whatever_order_they_are_posted_in():
    submitted = []
    rounds = InOrderRounds(lambda buf, splits, name: (submitted.append(name), name)[1],
                           [1, 3, 4, 6])
    for step in range(2):  # the order starts again every step
        posts = {i: rounds.post(i, np.zeros(0), [0], f"s{step}.r{i}") for i in (4, 6)}
        assert submitted[4 * step:] == []  # 1 and 3 not posted yet: nothing may go ahead
        posts[3] = rounds.post(3, np.zeros(0), [0], f"s{step}.r3")
        assert posts[3].outputs is None
        posts[1] = rounds.post(1, np.zeros(0), [0], f"s{step}.r1")
        assert submitted[4 * step:] == [f"s{step}.r{i}" for i in (1, 3, 4, 6)]
        assert all(posts[i].outputs == f"s{step}.r{i}" for i in posts)


def _cpu_seconds(seconds: float) -> float:
    """This process's CPU time over ``seconds`` of the main thread sleeping."""
    start = sum(os.times()[:2])
    time.sleep(seconds)
    return sum(os.times()[:2]) - start


def test_the_spinner_keeps_the_core_busy_only_while_entered():
    spinner = Spinner()
    with spinner:
        busy = _cpu_seconds(0.4)
    idle = _cpu_seconds(0.4)
    assert busy > 0.1, busy  # it spins while the main thread waits
    assert idle < 0.05, idle  # and stops when the wait is over
