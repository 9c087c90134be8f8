"""Data the Trainer reads by sample index: the Dataset contract, in-memory arrays, token windows.

A data set larger than memory is an object with a length and a ``batch(indices)`` method, for
example :class:`TokenWindows` over a memory-mapped token file: only the samples of a batch are
ever copied into memory. ``Trainer.fit(x, y)`` wraps in-memory arrays in :class:`ArrayDataset`.
"""

from __future__ import annotations

import hashlib
import mmap
import numbers
from typing import Any, Protocol, runtime_checkable

import numpy as np

from toolkit.errors import ToolkitError


@runtime_checkable
class Dataset(Protocol):
    """What the Trainer trains and evaluates on: a number of samples and a batch by index.

    ``batch`` receives this rank's sample indices from the sampler and returns new arrays
    ``(inputs, labels)``. The Trainer calls it from a background thread while the previous
    step runs (``Trainer(prefetch=True)``), so it must not depend on the order of calls or on
    anything the training step changes.

    A data set may also carry a ``fingerprint`` string that changes when its samples change
    (e.g. a hash of the corpus, the window length and the stride). Checkpoints record it, and
    resuming onto a data set with another fingerprint is refused. It is optional, so it is not
    part of the ``isinstance`` check, which looks for ``__len__`` and ``batch`` only.

    Example (a data set computed on the fly):
        >>> class Squares:
        ...     def __len__(self):
        ...         return 1000
        ...     def batch(self, indices):
        ...         x = indices.astype(np.float32)[:, None]
        ...         return x, x[:, 0] ** 2
        >>> isinstance(Squares(), Dataset)
        True
        >>> Squares().batch(np.array([3, 1]))[1]
        array([9., 1.], dtype=float32)
    """

    def __len__(self) -> int:
        """The number of samples."""

    def batch(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(inputs, labels)`` of the samples ``indices`` (a 1-D integer array), in order."""


class ArrayDataset:
    """In-memory arrays ``x`` (inputs) and ``y`` (labels) as a :class:`Dataset`.

    ``Trainer.fit(x, y)`` and ``Trainer.evaluate(x, y)`` wrap their arrays in one. It has no
    fingerprint (hashing every array at each checkpoint would cost more than it protects; the
    checkpointed sampler state already refuses a data set of another size).

    Example:
        >>> data = ArrayDataset(np.arange(10.0).reshape(5, 2), np.arange(5))
        >>> data.batch(np.array([4, 0]))
        (array([[8., 9.],
               [0., 1.]]), array([4, 0]))
    """

    def __init__(self, x: Any, y: Any):
        if len(x) != len(y):
            raise ToolkitError(f"x has {len(x)} samples but y has {len(y)}",
                               "pass inputs and labels of the same length")
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def batch(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.x[indices], self.y[indices]

    @property
    def in_memory(self) -> bool:
        """Whether ``x`` and ``y`` are numpy arrays in memory: not memory maps, nor views of
        one (also through ``np.asarray``), nor other array types."""
        def mapped(a: Any) -> bool:
            if not isinstance(a, np.ndarray):
                return True
            while a is not None:
                if isinstance(a, np.memmap | mmap.mmap):
                    return True
                a = getattr(a, "base", None)
            return False
        return not (mapped(self.x) or mapped(self.y))


class TokenWindows:
    """Next-token prediction windows over a 1-D array of token ids, read without copying it.

    Sample ``i`` is ``tokens[i*stride : i*stride + context + 1]``: its inputs are the first
    ``context`` ids, its labels the last ``context`` (the inputs shifted by one). The corpus
    may be a ``np.memmap`` larger than memory: the windows are a strided view of it, and
    :meth:`batch` copies only the windows asked for, as ``int64`` arrays ``(B, context)``.

    Args:
        tokens: the corpus, a 1-D integer array (e.g. ``toolkit.datasets.load_text().train``).
        context: tokens per sample (the model's sequence length).
        stride: tokens between the starts of consecutive samples; defaults to ``context``
            (windows that share only their boundary token). Smaller strides overlap.
        vocab: the number of token ids; :meth:`batch` refuses ids outside ``[0, vocab)``.

    Attributes:
        fingerprint: the corpus's length, dtype and SHA-256, the context and the stride
            (computed on first use: it reads the whole corpus once).

    Example:
        >>> data = TokenWindows(np.arange(10, dtype=np.uint8), context=3)
        >>> len(data)
        3
        >>> x, y = data.batch(np.array([1]))
        >>> x.tolist(), y.tolist()
        ([[3, 4, 5]], [[4, 5, 6]])
    """

    def __init__(self, tokens: np.ndarray, context: int, stride: int | None = None,
                 vocab: int = 256):
        if not isinstance(tokens, np.ndarray):
            tokens = np.asarray(tokens)
        if tokens.ndim != 1:
            raise ToolkitError(f"tokens must be a 1-D array of token ids, got shape "
                               f"{tokens.shape}", "flatten the corpus into one sequence")
        if not np.issubdtype(tokens.dtype, np.integer):
            raise ToolkitError(f"token ids must be integers, got dtype {tokens.dtype}",
                               "pass an integer array, e.g. np.uint8 bytes or np.int32 ids")
        stride = context if stride is None else stride
        for name, value in (("context", context), ("stride", stride), ("vocab", vocab)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ToolkitError(f"TokenWindows {name}={value!r} must be a positive integer",
                                   "e.g. TokenWindows(tokens, context=64, vocab=256)")
        self.context, self.stride, self.vocab = int(context), int(stride), int(vocab)
        if len(tokens) < self.context + 1:
            raise ToolkitError(
                f"the corpus has {len(tokens)} tokens, fewer than one window of context + 1 = "
                f"{self.context + 1} (inputs and the shifted labels)",
                f"use a context of at most {max(1, len(tokens) - 1)} or a longer corpus")
        self.tokens = tokens
        # A view: row i starts at token i*stride; nothing is copied until batch() indexes it.
        self.windows = np.lib.stride_tricks.sliding_window_view(
            tokens, self.context + 1)[::self.stride]
        info = np.iinfo(tokens.dtype)
        self._ids_checked = info.min >= 0 and info.max < self.vocab  # uint8 with vocab 256
        self._fingerprint: str | None = None

    def __len__(self) -> int:
        return self.windows.shape[0]

    def __repr__(self) -> str:
        return (f"TokenWindows({len(self)} windows of {len(self.tokens)} tokens, "
                f"context={self.context}, stride={self.stride}, vocab={self.vocab})")

    def batch(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Inputs and labels ``(len(indices), context)`` of the windows ``indices``, int64."""
        indices = np.asarray(indices)
        if indices.ndim != 1 or not np.issubdtype(indices.dtype, np.integer):
            raise ToolkitError(f"batch() needs a 1-D integer index array, got "
                               f"{indices.dtype}{list(indices.shape)}",
                               "pass sample indices such as the sampler's")
        if len(indices) and (indices.min() < 0 or indices.max() >= len(self)):
            bad = indices[(indices < 0) | (indices >= len(self))][0]
            raise IndexError(f"window {bad} outside the {len(self)} windows of {self!r}")
        rows = self.windows[indices]  # the only copy: this batch's windows
        if not self._ids_checked:
            self._check_ids(rows, indices)
        return (np.ascontiguousarray(rows[:, :-1], dtype=np.int64),
                np.ascontiguousarray(rows[:, 1:], dtype=np.int64))

    def _check_ids(self, rows: np.ndarray, indices: np.ndarray) -> None:
        if not len(rows) or (rows.min() >= 0 and rows.max() < self.vocab):
            return
        r, c = np.argwhere((rows < 0) | (rows >= self.vocab))[0]
        raise ToolkitError(
            f"token id {rows[r, c]} (at corpus position {indices[r] * self.stride + c}) is "
            f"outside the vocabulary of {self.vocab} ids",
            f"token ids must lie in [0, {self.vocab}): pass TokenWindows(..., vocab=N) with N "
            "above the largest id, and build the model with the same vocabulary")

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = (
                f"TokenWindows(tokens={len(self.tokens)}x{self.tokens.dtype.str}, "
                f"sha256={array_sha256(self.tokens)[:16]}, context={self.context}, "
                f"stride={self.stride})")
        return self._fingerprint


def array_sha256(array: np.ndarray, chunk: int = 1 << 24) -> str:
    """SHA-256 of an array's bytes in C order, read in chunks (a memmap is never copied whole)."""
    digest = hashlib.sha256()
    flat = array if array.ndim == 1 else array.reshape(-1)  # 1-D: chunks of a strided view
    for start in range(0, len(flat), chunk):
        digest.update(np.ascontiguousarray(flat[start:start + chunk]).view(np.uint8))
    return digest.hexdigest()


def as_dataset(data: Any, y: Any = None, *, what: str = "the data") -> Dataset:
    """``(x, y)`` arrays (or one ``(x, y)`` tuple) as an :class:`ArrayDataset`; a
    :class:`Dataset` as it is.

    Raises:
        ToolkitError: for anything else, naming its type and what it lacks.
    """
    if y is not None:
        if isinstance(data, Dataset):
            raise ToolkitError(
                f"{what} is a data set ({type(data).__name__}) and labels were passed too",
                "pass the data set alone (its batch() returns the labels) and validation "
                "data by keyword: fit(train, validation=val)")
        return ArrayDataset(data, y)
    if isinstance(data, tuple) and len(data) == 2:  # (x, y), as validation data comes
        return ArrayDataset(*data)
    if isinstance(data, Dataset):
        return data
    kind = type(data)
    missing = " and no ".join(f"{m}()" for m in ("__len__", "batch") if not hasattr(data, m))
    raise ToolkitError(
        f"{what} is a {kind.__module__}.{kind.__qualname__}, which has no {missing}: it is "
        "neither (x, y) arrays nor a data set",
        "pass inputs and labels, fit(x, y), or an object with __len__() and "
        "batch(indices) -> (inputs, labels), such as toolkit.TokenWindows")
