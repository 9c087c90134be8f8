"""The Horovod pipeline executors' message plumbing, framework-free: how a round's messages
are packed into one alltoall buffer, the order horovod-tf submits its rounds in, and the
thread that keeps a waiting stage's core busy."""

from __future__ import annotations

import os
import time
from functools import partial

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


def _as_16_bit(narrow, words, code):
    return words.view(narrow[code])


def test_sixteen_bit_tensors_travel_two_to_a_float32_element_bit_for_bit():
    """horovod-torch under mixed precision: a bfloat16 or float16 activation keeps its dtype
    in a float32 message, in half the bytes (an odd count padded by one value); float32 and
    float64 tensors are converted to the buffer's dtype as before."""
    torch = pytest.importorskip("torch")
    from adapters.horovod_torch.pipeline import pack_tensors

    g = torch.Generator().manual_seed(0)
    a = torch.randn(3, 5, generator=g).to(torch.bfloat16)  # 15 values: 8 elements
    b = torch.randn(4, generator=g, dtype=torch.float64)
    c = (torch.randn(2, 3, generator=g) * 1e3).to(torch.float16)
    c[0, 0] = float("inf")  # any bits: the alltoall moves bytes, never values
    buf, splits = pack_tensors(torch, {1: [a, b], 0: [c]}, 2, torch.float32, "cpu")
    assert buf.dtype == torch.float32
    assert splits == [1 + 2 + 3, (1 + 2 + 8) + (1 + 1 + 4)]
    narrow = {1: torch.bfloat16, 2: torch.float16}
    view = partial(_as_16_bit, narrow)  # (as TorchPipeline._narrow)
    got_c, end = unpack(buf[:splits[0]], 0, view)
    got_a, offset = unpack(buf[splits[0]:], 0, view)
    got_b, end_b = unpack(buf[splits[0]:], offset, view)
    assert end == splits[0] and end_b == splits[1]
    for got, want in ((got_a, a), (got_c, c)):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert got_b.dtype == torch.float32 and torch.equal(got_b, b.float())
    with pytest.raises(ValueError, match="16-bit values"):
        from adapters._horovod.rounds import RoundMessages

        unpack(buf[splits[0]:], 0, RoundMessages()._narrow)


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
