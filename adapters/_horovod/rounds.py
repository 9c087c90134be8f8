"""How the Horovod pipeline executors move a step's messages (framework-free, numpy only).

Horovod has no send/recv. Each lockstep round of the schedule (``toolkit.lockstep_rounds``)
that passes messages is **one** ``hvd.alltoall`` over the whole world, named after the round,
with a split for each receiving rank and zero for the others; several messages to one rank are
concatenated in the schedule's order, each as ``[ndim, *shape, values...]``, in one flat buffer of
the backend's dtype (``pack``/``unpack``; each array is copied once, into a 64-byte-aligned
buffer that horovod-tf hands to TensorFlow without another copy).

Every rank joins every round's alltoall. Where the alltoall is asynchronous (``asynchronous =
True``: horovod-torch's ``hvd.alltoall_async``; horovod-tf's alltoall on an asynchronous
TensorFlow executor), a stage joins every round in which it sends nothing at the very start of
the step, and a round in which it sends as soon as its payload is computed; it waits for a round
only when an action needs that round's message. A sender therefore never waits, and a receiver
has already joined when the message is sent. Horovod matches collectives by name whatever order
ranks submit them in, and no rank ever waits for a round whose senders are themselves waiting on
a later round (a sender's inputs come from earlier rounds), so nothing can deadlock. Eager
horovod-tf ignores names and matches ops by the order ranks submit them in, so every rank
submits the rounds' alltoalls in the rounds' order: a stage's payload for round ``r`` needs only
rounds before ``r``, which that order completes first, so this cannot deadlock either. Where the
alltoall is synchronous (the default hooks), every rank runs the rounds in order and each
alltoall completes as it is called.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

ALIGNMENT = 64  # bytes: what TensorFlow requires of a buffer it takes without a copy (DLPack)


NARROW = {"bfloat16": 1, "float16": 2}  # a 16-bit array in a float32 message: its code


def _code(array: np.ndarray, dtype) -> int:
    """``array``'s :data:`NARROW` code in a message of ``dtype`` (0: converted to it)."""
    return NARROW.get(np.asarray(array).dtype.name, 0) if np.dtype(dtype) == np.float32 else 0


def packed_size(array: np.ndarray, dtype) -> int:
    """How many elements of ``dtype`` ``array`` takes in a message: ``[ndim, *shape,
    values...]``, a 16-bit array's values two to an element of a float32 message."""
    size = int(np.size(array))
    return 1 + np.ndim(array) + ((size + 1) // 2 if _code(array, dtype) else size)


def pack_into(buf: np.ndarray, offset: int, array: np.ndarray) -> int:
    """Writes ``array`` as ``[ndim + 16 * code, *shape, values...]`` at ``offset`` of ``buf``
    (one copy, converted to ``buf``'s dtype, or a 16-bit array's bits as they are:
    :func:`unpack`); returns the offset after it."""
    array = np.asarray(array)
    code = _code(array, buf.dtype)
    start = offset + 1 + array.ndim
    buf[offset] = array.ndim + 16 * code
    buf[offset + 1:start] = array.shape
    if code:
        words = (array.size + 1) // 2
        bits = buf[start:start + words].view(np.uint16)
        bits[:array.size] = array.reshape(-1).view(np.uint16)
        bits[array.size:] = 0
        return start + words
    buf[start:start + array.size] = array.reshape(-1)
    return start + array.size


def unpack(buf: np.ndarray, offset: int, narrow: Any = None) -> tuple[np.ndarray, int]:
    """The array ``pack_into`` wrote at ``offset`` of ``buf`` (a view), and the offset after it.
    ``buf`` may be a framework tensor packed the same way (a view of it comes back); its header
    is read with one copy to the host.

    A header's first element is ``ndim + 16 * code``: code 0, the values in ``buf``'s dtype;
    a code of :data:`NARROW`, 16-bit values two to an element of a float32 ``buf`` (a
    bfloat16 activation under mixed precision travels in half the bytes of its float32 value,
    bit for bit), read by ``narrow(words, code)``: the words as that dtype's values."""
    code, ndim = divmod(int(buf[offset]), 16)
    shape = [int(d) for d in buf[offset + 1:offset + 1 + ndim].tolist()]
    start = offset + 1 + ndim
    size = int(np.prod(shape))
    if code:
        words = (size + 1) // 2
        return narrow(buf[start:start + words], code)[:size].reshape(shape), start + words
    return buf[start:start + size].reshape(shape), start + size


def aligned_empty(size: int, dtype) -> np.ndarray:
    """``np.empty(size, dtype)`` whose data starts on a multiple of ``ALIGNMENT`` bytes."""
    dtype = np.dtype(dtype)
    raw = np.empty(size * dtype.itemsize + ALIGNMENT, np.uint8)
    offset = -raw.ctypes.data % ALIGNMENT
    return raw[offset:offset + size * dtype.itemsize].view(dtype)


def pack(outgoing: dict[int, list[np.ndarray]], world_size: int,
         dtype) -> tuple[np.ndarray, list[int]]:
    """One flat buffer of ``dtype`` (``ALIGNMENT``-aligned) with ``outgoing[rank]``'s arrays
    packed in order, rank after rank, and the alltoall's splits (the elements for each rank).
    Each array is copied once."""
    splits = [0] * world_size
    for r, arrays in outgoing.items():
        splits[r] = sum(packed_size(a, dtype) for a in arrays)
    buf = aligned_empty(sum(splits), dtype)
    offset = 0
    for r in sorted(outgoing):
        for array in outgoing[r]:
            offset = pack_into(buf, offset, array)
    return buf, splits


class RoundMessages:
    """The message part of ``HvdPipeline`` (see the module's docstring). Needs ``env``,
    ``grid``, ``stage``, ``replica``, ``rounds``, ``recorder``, ``steps``, ``np_dtype``,
    and the hooks ``_alltoall`` (or ``_alltoall_start`` and ``_alltoall_wait``), ``_host``,
    ``_activation`` and ``_is_last``. The schedule's rounds go through ``_round_start``, which
    packs numpy arrays into a host buffer unless an executor packs its own tensors (horovod-torch:
    on the rank's device, so a GPU's messages go through NCCL); ``unpack`` reads either. The
    other exchanges (evaluation, buffers) stay host arrays."""

    asynchronous = False  # True where _alltoall_start returns before the alltoall completes
    message_bytes = 0  # what this rank sent in the last step's rounds (its packed buffers)

    def _narrow(self, words: Any, code: int) -> Any:
        """(hook) A round's float32 ``words`` as the 16-bit values of ``NARROW`` code
        ``code``, where the executor packs such arrays (horovod-torch under mixed
        precision)."""
        raise ValueError(f"a message of 16-bit values (code {code}) this executor never sends")

    def _plan_rounds(self) -> None:
        """Which round delivers each of this stage's receives, and each message round's slot
        in ``exchange_seconds`` (the same on every rank)."""
        self.delivered: dict[tuple[str, int, int], int] = {}
        self.slot: dict[int, int] = {}
        self.sends: set[int] = set()
        for index, rnd in enumerate(self.rounds):
            if rnd.messages:
                self.slot[index] = len(self.slot)
            for sender, receiver, _, recv in rnd.messages:
                if receiver == self.stage:
                    self.delivered[(recv.kind, recv.micro_batch, recv.chunk)] = index
                if sender == self.stage:
                    self.sends.add(index)

    # ------------------------------------------------------------------------------ collectives
    def _exchange(self, outgoing: dict[int, list[np.ndarray]], dtype,
                  name: str) -> dict[int, np.ndarray]:
        """One alltoall over the world: the arrays ``outgoing[rank]`` (packed) to each rank;
        returns the flat buffer each rank sent here (``unpack`` reads its arrays in order;
        ranks that sent nothing are absent). Every rank must call it.

        Every collective of the executor is named (``name``): ranks of different stages join
        different process sets, so horovod.torch's unnamed ops (numbered per process) would not
        match across ranks. (Eager horovod-tf ignores names and matches ops by the order they
        are submitted in, which it keeps the same on every rank: see the module docstring.)"""
        return self._exchange_finish(self._exchange_start(outgoing, dtype, name))

    def _exchange_start(self, outgoing: dict[int, list[np.ndarray]], dtype, name: str) -> Any:
        return self._alltoall_start(*pack(outgoing, self.env.world_size, dtype), name)

    def _round_start(self, outgoing: dict[int, list[Any]], dtype, name: str) -> Any:
        """Joins one of the schedule's rounds with ``outgoing``'s payloads (framework tensors);
        default: as host arrays, through :meth:`_exchange_start`."""
        host = {r: [self._host(t) for t in payloads] for r, payloads in outgoing.items()}
        buf, splits = pack(host, self.env.world_size, dtype)
        self.message_bytes += buf.nbytes
        return self._alltoall_start(buf, splits, name)

    def _exchange_finish(self, started: Any) -> dict[int, np.ndarray]:
        got, sizes = self._alltoall_wait(started)
        ends = np.cumsum(sizes)
        return {r: got[ends[r] - n:ends[r]] for r, n in enumerate(sizes) if n}

    def _alltoall_start(self, buf: np.ndarray, splits: list[int], name: str) -> Any:
        """Default: the synchronous ``_alltoall``; asynchronous executors override this and
        ``_alltoall_wait`` and set ``asynchronous``."""
        return self._alltoall(buf, splits, name)

    def _alltoall_wait(self, started: Any) -> tuple[np.ndarray, list[int]]:
        return started

    # ------------------------------------------------------------------------------ a step's rounds
    def _start_rounds(self) -> None:
        """Fresh boxes; asynchronous executors join now every round this stage sends nothing in."""
        self.outbox, self.inbox_f, self.inbox_b = {}, {}, {}
        self.pending: dict[int, tuple[Any, list]] = {}
        self.exchange_seconds = [0.0] * len(self.slot)  # per message round: joining + waiting
        if self.asynchronous:
            for index in self.slot:
                if index not in self.sends:
                    self._post(index)

    def _post(self, index: int) -> None:
        """Joins round ``index``'s alltoall with this stage's messages (from the outbox)."""
        rank, dtype, rnd = self.grid.rank, self.np_dtype, self.rounds[index]
        out: dict[int, list] = {}
        expected = []
        for sender, receiver, send, recv in rnd.messages:
            if sender == self.stage:
                payload = self.outbox.pop((send.kind, send.micro_batch, send.chunk))
                out.setdefault(rank(receiver, self.replica), []).append(payload)
            if receiver == self.stage:
                expected.append((rank(sender, self.replica), recv))
        start = time.time()
        started = self._round_start(out, dtype, f"pipeline.round.{index}")
        if out and self.asynchronous:
            # Let Horovod's background thread, which moves the message, take the core before
            # this stage's next compute does: the receiver is waiting for it. Pinned, S = 2,
            # M = 8: idle 0.150-0.155 / 0.157-0.158 (GPipe / 1F1B) in three runs, against
            # 0.154-0.162 / 0.161-0.162 without.
            os.sched_yield()
        end = time.time()
        self.exchange_seconds[self.slot[index]] += end - start
        for sender, _, send, _ in rnd.messages:
            if sender == self.stage:
                self.recorder.add(send, start, end, self.steps)
        self.pending[index] = (started, expected)

    def _after_compute(self, index: int) -> None:
        """Round ``index``'s compute is done: join its alltoall unless it was joined at the
        step's start (asynchronous, nothing to send)."""
        if index in self.slot and (index in self.sends or not self.asynchronous):
            self._post(index)

    def _wanted(self, action=None) -> list[int]:
        """The joined rounds ``_await(action)`` waits for: the one that brings ``action``'s
        input, if not received yet (every joined round when ``action`` is None)."""
        if action is None:
            return sorted(self.pending)
        key = (action.micro_batch, action.chunk)
        first = action.chunk * self.grid.stages + self.stage == 0
        need = (None if (first if action.kind == "F" else self._is_last(action.chunk))
                else self.delivered[("RECV_" + action.kind, *key)])
        return [need] if need in self.pending else []

    def _await(self, action=None) -> None:
        """Waits for the round that brings ``action``'s input (every joined round when
        ``action`` is None); the wait is recorded as the RECV actions."""
        for index in self._wanted(action):
            started, expected = self.pending.pop(index)
            start = time.time()
            got = self._exchange_finish(started)
            end = time.time()
            self.exchange_seconds[self.slot[index]] += end - start
            offsets: dict[int, int] = {}
            for src, recv in expected:
                array, offsets[src] = unpack(got[src], offsets.get(src, 0), self._narrow)
                key = (recv.micro_batch, recv.chunk)
                if recv.kind == "RECV_F":
                    self.inbox_f[key] = self._activation(array, grad=True)
                else:
                    self.inbox_b[key] = self._activation(array, grad=False)
                self.recorder.add(recv, start, end, self.steps)
