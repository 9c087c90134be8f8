"""Loading the next local batch in a background thread while the current step runs."""

from __future__ import annotations

import copy
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from toolkit.data.dataset import ArrayDataset, Dataset
from toolkit.data.sampler import GlobalBatchSampler
from toolkit.errors import ToolkitError


class _Failure:
    """An exception raised in the loading thread, carried to the training thread."""

    def __init__(self, error: BaseException):
        self.error = error


class BatchPrefetcher:
    """Turns this rank's sample indices into batches, one step ahead of training.

    The thread follows its own copy of the sampler, so running ahead never moves the position
    that checkpoints record: the training loop keeps iterating the real sampler and passes each
    step's indices to :meth:`get`, which checks that the batch loaded ahead is that one. A
    resume mid-epoch therefore needs nothing special (the copy starts where the sampler is),
    and a stop after any step leaves at most two loaded batches unused.

    Args:
        dataset: the :class:`Dataset` to load from (``dataset.batch(indices)``).
        sampler: the training sampler at the position training continues from (copied).
        steps: batches to load at most (the steps the loop will make).
        prefetch: load in a background thread; ``False`` loads inside :meth:`get`.
        place: ``place(inputs, labels) -> (inputs, labels)`` applied to each loaded batch, in
            the thread (the adapter's ``device_batch``: the copy to the devices overlaps the
            running step); counted as loading.

    Use it as a context manager (or call :meth:`close`): leaving it stops and joins the thread.
    An exception in the thread is raised by :meth:`get` of the step that needed the batch.
    """

    def __init__(self, dataset: Dataset, sampler: GlobalBatchSampler, steps: int, *,
                 prefetch: bool = True, place: Callable[[Any, Any], tuple[Any, Any]] | None = None):
        self.dataset, self.prefetch, self.place = dataset, prefetch and steps > 0, place
        self.batches = 0
        # Two different clocks, neither a part of the other (see stats()):
        self.load_seconds = 0.0  # making the batches (in the thread, or in get without it)
        self.wait_seconds = 0.0  # the training thread blocked in get() until each was there
        self._queue: queue.Queue = queue.Queue(maxsize=1)  # plus one in the making
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.prefetch:
            ahead = _indices(copy.copy(sampler), steps)
            self._thread = threading.Thread(target=self._work, args=(ahead,), daemon=True,
                                            name="toolkit-prefetch")
            self._thread.start()

    def __enter__(self) -> BatchPrefetcher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def get(self, indices: np.ndarray) -> tuple[Any, Any]:
        """``(inputs, labels)`` of ``indices``, the sampler's next local batch."""
        if self._thread is None:
            start = time.perf_counter()
            batch = self._load(indices)
            seconds = time.perf_counter() - start
            self._account(seconds, seconds)
            return batch
        start = time.perf_counter()
        item = self._next()
        waited = time.perf_counter() - start
        if isinstance(item, _Failure):
            raise item.error
        loaded, batch, seconds = item
        if not np.array_equal(loaded, indices):  # a bug in the Trainer, not the user's data
            raise RuntimeError("the prefetch thread loaded other samples than the sampler "
                               "handed out")
        self._account(seconds, waited)
        return batch

    def _next(self) -> Any:
        while True:
            try:
                return self._queue.get(timeout=0.1)
            except queue.Empty:
                if self._thread is not None and not self._thread.is_alive():
                    try:
                        return self._queue.get_nowait()
                    except queue.Empty:
                        raise RuntimeError("the prefetch thread ended before the training "
                                           "loop; it was asked for too few steps") from None

    def _account(self, load: float, waited: float) -> None:
        self.batches += 1
        self.load_seconds += load
        self.wait_seconds += waited

    def _work(self, ahead: Iterator[np.ndarray]) -> None:
        try:
            start = time.perf_counter()
            for indices in ahead:  # (drawing an epoch's permutation counts as loading too)
                batch = self._load(indices)
                if not self._put((indices, batch, time.perf_counter() - start)):
                    return
                start = time.perf_counter()
        except BaseException as err:  # re-raised in the training thread by get()
            self._put(_Failure(err))

    def _load(self, indices: np.ndarray) -> tuple[Any, Any]:
        batch = load_batch(self.dataset, indices)
        return batch if self.place is None else self.place(*batch)

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def close(self) -> None:
        """Stops the thread and waits for it (it finishes the batch it is loading, if any)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        while not self._queue.empty():
            self._queue.get_nowait()

    def stats(self) -> dict[str, Any]:
        """What loading the batches handed out so far cost, and what it cost training.

        - ``load_seconds``: the time spent making them: in the thread, from starting a batch
          (drawing its indices, ``dataset.batch``, ``place``) until it is ready, not counting
          the thread's waits to hand a batch over (the queue holds one); without the thread,
          the time :meth:`get` spent loading.
        - ``wait_seconds``: the time the training thread spent blocked in :meth:`get` until
          its batch was there: the loading not yet done when training asked for it, plus
          the hand-over between the threads (a wake-up, and the interpreter lock, which a
          step that holds it keeps from the thread until training waits). It is not a part
          of ``load_seconds`` and can exceed it; without the thread the two are equal.
        - ``hidden_fraction``: ``1 - wait / load`` within [0, 1] (1: training never waited;
          0 without the thread, or when the waits cost as much as the loading). The first
          batch is never hidden: nothing runs while it loads.
        """
        load, wait = self.load_seconds, self.wait_seconds
        hidden = min(1.0, max(0.0, 1.0 - wait / load)) if load > 0 else (
            1.0 if self.prefetch else 0.0)
        return {"prefetch": self.prefetch, "batches": self.batches,
                "load_seconds": round(load, 6), "wait_seconds": round(wait, 6),
                "hidden_fraction": round(hidden, 4)}


def _indices(sampler: GlobalBatchSampler, steps: int) -> Iterator[np.ndarray]:
    """The sampler's next ``steps`` local index arrays, across epoch ends as training goes."""
    made = 0
    while made < steps:
        for indices in sampler:
            yield indices
            made += 1
            if made == steps:
                return


def load_batch(dataset: Dataset, indices: np.ndarray) -> tuple[Any, Any]:
    """``dataset.batch(indices)``, checked to be a pair ``(inputs, labels)``."""
    batch = dataset.batch(indices)
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
        raise ToolkitError(f"{type(dataset).__name__}.batch() returned a "
                           f"{type(batch).__name__}, not a pair (inputs, labels)",
                           "return a tuple (inputs, labels) of arrays with one row per index")
    return tuple(batch)


def prefetches(data, setting: bool | str) -> bool:
    """Whether ``fit`` loads ``data`` in the prefetch thread (``Trainer(prefetch=setting)``;
    ``"auto"``: unless its arrays are in memory, since a memory map reads from disk)."""
    if setting != "auto":
        return bool(setting)
    return not (type(data) is ArrayDataset and data.in_memory)


def check_prefetch(setting: bool | str) -> bool | str:
    """``Trainer(prefetch=setting)`` as given, or a ToolkitError."""
    if setting not in (True, False, "auto"):
        raise ToolkitError(f"prefetch={setting!r} is not True, False or 'auto'",
                           "'auto' (the default) loads in a thread unless the data are "
                           "in memory")
    return setting
