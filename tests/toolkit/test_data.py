"""Data sets by index: TokenWindows against an obvious slicing loop, no copies of the corpus,
ArrayDataset, the Dataset protocol and the errors a user sees."""

import numpy as np
import pytest

import toolkit
from toolkit import ArrayDataset, Dataset, TokenWindows, ToolkitError
from toolkit.data.dataset import array_sha256, as_dataset


def slow_windows(tokens, context, stride):
    """Every window by hand: sample i starts at i*stride and needs context + 1 tokens."""
    xs, ys, start = [], [], 0
    while start + context + 1 <= len(tokens):
        chunk = [int(t) for t in tokens[start:start + context + 1]]
        xs.append(chunk[:-1])
        ys.append(chunk[1:])
        start += stride
    return np.array(xs), np.array(ys)


@pytest.mark.parametrize("n, context, stride", [
    (100, 8, None), (100, 8, 3), (100, 8, 8), (9, 8, None), (50, 1, 1), (37, 5, 11)])
def test_windows_and_shift_match_a_slicing_loop(n, context, stride):
    tokens = np.random.default_rng(n).integers(0, 256, n).astype(np.uint8)
    data = TokenWindows(tokens, context, stride)
    x, y = slow_windows(tokens, context, stride or context)
    assert len(data) == len(x)
    order = np.random.default_rng(0).permutation(len(x))  # any order, repeats allowed
    indices = np.concatenate([order, order[:2]])
    bx, by = data.batch(indices)
    assert bx.dtype == by.dtype == np.int64 and bx.shape == (len(indices), context)
    assert bx.flags.c_contiguous and by.flags.c_contiguous
    np.testing.assert_array_equal(bx, x[indices])
    np.testing.assert_array_equal(by, y[indices])
    np.testing.assert_array_equal(by[:, :-1], bx[:, 1:])  # labels are the inputs shifted by one


def test_reads_a_memmap_without_copying_it(tmp_path):
    path = tmp_path / "corpus.npy"
    np.save(path, np.arange(10_000, dtype=np.int32) % 256)
    tokens = np.load(path, mmap_mode="r")
    data = TokenWindows(tokens, 16, stride=4)
    assert np.shares_memory(data.windows, tokens)  # the windows are a view of the file
    assert data.tokens is tokens
    x, y = data.batch(np.array([0, 7]))
    assert not np.shares_memory(x, tokens) and not np.shares_memory(y, tokens)
    np.testing.assert_array_equal(x[1], np.arange(28, 44) % 256)


def test_fingerprint_names_hash_context_and_stride():
    tokens = np.arange(1000, dtype=np.uint8)
    fp = TokenWindows(tokens, 16).fingerprint
    assert fp == TokenWindows(tokens.copy(), 16).fingerprint  # the content, not the object
    assert "context=16" in fp and "stride=16" in fp and array_sha256(tokens)[:16] in fp
    others = {TokenWindows(tokens, 8).fingerprint, TokenWindows(tokens, 16, 8).fingerprint,
              TokenWindows(tokens[::-1], 16).fingerprint}
    assert fp not in others and len(others) == 3


def test_array_sha256_is_hashlib_on_the_bytes():
    import hashlib

    a = np.arange(5000, dtype=np.int64)
    assert array_sha256(a, chunk=777) == hashlib.sha256(a.tobytes()).hexdigest()
    assert array_sha256(a[::3], chunk=100) == hashlib.sha256(a[::3].tobytes()).hexdigest()


@pytest.mark.parametrize("make, match", [
    (lambda: TokenWindows(np.arange(8), context=8),
     r"the corpus has 8 tokens, fewer than one window of context \+ 1 = 9"),
    (lambda: TokenWindows(np.zeros((4, 4), np.int64), 2), r"1-D array.*shape \(4, 4\)"),
    (lambda: TokenWindows(np.zeros(20, np.float32), 2), "must be integers, got dtype float32"),
    (lambda: TokenWindows(np.zeros(20, np.int64), 0), "context=0 must be a positive integer"),
    (lambda: TokenWindows(np.zeros(20, np.int64), 4, stride=0), "stride=0 must be a positive"),
    (lambda: TokenWindows(np.zeros(20, np.int64), 4, vocab=0), "vocab=0 must be a positive"),
])
def test_bad_corpus_or_arguments(make, match):
    with pytest.raises(ToolkitError, match=match) as err:
        make()
    assert "HINT:" in str(err.value)


def test_token_ids_outside_the_vocabulary_name_the_id_and_the_size():
    tokens = np.arange(100, dtype=np.int64)
    data = TokenWindows(tokens, 4, vocab=50)
    data.batch(np.array([0, 5]))  # windows below 50 are fine
    with pytest.raises(ToolkitError, match=r"token id 50 \(at corpus position 50\) is outside "
                                           r"the vocabulary of 50 ids"):
        data.batch(np.array([3, 12, 20]))  # window 12 holds tokens 48..52
    negative = TokenWindows(np.array([1, 2, -3, 4, 5]), 2, stride=1, vocab=10)
    with pytest.raises(ToolkitError, match="token id -3"):
        negative.batch(np.array([1]))


def test_bad_indices():
    data = TokenWindows(np.arange(40, dtype=np.uint8), 4)
    assert len(data) == 9  # starts 0, 4, ..., 32; the last needs tokens 32..36
    with pytest.raises(IndexError, match="window 9 outside the 9 windows"):
        data.batch(np.array([0, 9]))
    with pytest.raises(IndexError, match="window -1"):
        data.batch(np.array([-1]))
    with pytest.raises(ToolkitError, match="1-D integer index array"):
        data.batch(np.array([0.5]))


def test_array_dataset():
    x, y = np.arange(20.0).reshape(10, 2), np.arange(10) % 3
    data = ArrayDataset(x, y)
    assert len(data) == 10 and getattr(data, "fingerprint", None) is None
    bx, by = data.batch(np.array([9, 2]))
    np.testing.assert_array_equal(bx, x[[9, 2]])
    np.testing.assert_array_equal(by, y[[9, 2]])
    with pytest.raises(ToolkitError, match="x has 10 samples but y has 4"):
        ArrayDataset(x, y[:4])


def test_the_protocol_and_as_dataset():
    class Squares:
        def __len__(self):
            return 5

        def batch(self, indices):
            return indices, indices ** 2

    tokens = TokenWindows(np.arange(30, dtype=np.uint8), 4)
    for ok in (Squares(), tokens, ArrayDataset(np.zeros(3), np.zeros(3))):
        assert isinstance(ok, Dataset)
        assert as_dataset(ok) is ok
    assert not isinstance(np.zeros(3), Dataset) and not isinstance([1, 2], Dataset)
    assert isinstance(as_dataset(np.zeros(3), np.ones(3)), ArrayDataset)
    assert isinstance(as_dataset((np.zeros(3), np.ones(3))), ArrayDataset)
    assert toolkit.Dataset is Dataset


@pytest.mark.parametrize("data, y, match", [
    (object(), None, r"the data is a builtins.object, which has no __len__\(\) and no batch\(\)"),
    (np.zeros(3), None, r"numpy.ndarray, which has no batch\(\)"),
    ([1, 2, 3], None, r"builtins.list, which has no batch\(\)"),
    (TokenWindows(np.arange(30, dtype=np.uint8), 4), np.zeros(7),
     r"is a data set \(TokenWindows\) and labels were passed too"),
])
def test_what_is_not_a_dataset(data, y, match):
    with pytest.raises(ToolkitError, match=match) as err:
        as_dataset(data, y)
    assert "HINT:" in str(err.value)
