"""Pipeline schedules as plain data: for each stage, the ordered actions it runs in one step.

An executor is a loop over its stage's list: ``F`` runs the forward of a micro-batch through one
of the stage's chunks, ``B`` its backward; ``SEND_F``/``RECV_F`` move activations to / from the
next / previous stage, ``SEND_B``/``RECV_B`` their gradients the other way. A send and its receive
are a pair (``peer`` names the other stage): the lists are ordered so that they run to the end
even when every send blocks until its receive is posted and every receive until its send is (a
rendezvous, the strictest semantics: a broadcast in a 2-rank group, a blocking send/recv).

``chunk`` is the stage's *local* model chunk (``0 .. v-1``); local chunk ``c`` of stage ``s``
is the virtual stage ``c*S + s`` of the ``S*v`` pieces the model is cut into (Megatron-LM's
interleaving). Every schedule but ``interleaved-1f1b`` has one chunk per stage.

A generator only decides each stage's order of forwards and backwards; where the sends and
receives go follows from one reference run of that order (forward 1, backward 2 time units,
messages delivered as soon as they are produced): every message gets the time it is produced
and both ends place it at that time, so all stages meet their messages in one global order,
which is why no rendezvous can deadlock (``validate_schedule`` checks it by running the lists).
"""

from __future__ import annotations

import dataclasses
import re

from toolkit.errors import ToolkitError
from toolkit.parallel.layouts import SCHEDULES, Pipeline

KINDS = ("F", "B", "SEND_F", "RECV_F", "SEND_B", "RECV_B")
_ACTION = re.compile(r"^(SEND_F|RECV_F|SEND_B|RECV_B|F|B)(\d+)(?:\.c(\d+))?$")


@dataclasses.dataclass(frozen=True)
class Action:
    """One step of a stage's schedule; ``str`` gives its compact form (``F3``, ``B3.c1``,
    ``SEND_F3``, ``RECV_B0.c1``) and ``Action.parse`` reads it back.

    Attributes:
        kind: one of ``F``, ``B``, ``SEND_F``, ``RECV_F``, ``SEND_B``, ``RECV_B``.
        micro_batch: the micro-batch ``m``.
        chunk: the stage's local model chunk (0 unless interleaved).
        peer: the stage at the other end of a send or receive (``None`` for ``F`` and ``B``).
    """

    kind: str
    micro_batch: int
    chunk: int = 0
    peer: int | None = dataclasses.field(default=None, compare=False)

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}" + (f".c{self.chunk}" if self.chunk else "")

    @property
    def is_compute(self) -> bool:
        return self.kind in ("F", "B")

    @classmethod
    def parse(cls, text: str) -> Action:
        """The action ``text`` writes (without its peer).

        Example:
            >>> Action.parse("SEND_F3.c1")
            Action(kind='SEND_F', micro_batch=3, chunk=1, peer=None)
        """
        match = _ACTION.match(str(text).strip())
        if not match:
            raise ToolkitError(f"{text!r} is not a pipeline action",
                               "write e.g. F3, B3, F3.c1, SEND_F3, RECV_B2.c1")
        kind, m, c = match.groups()
        return cls(kind, int(m), int(c or 0))


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Every stage's ordered actions for one training step.

    Attributes:
        name: the schedule's name (``gpipe``, ``1f1b``, ``interleaved-1f1b``).
        stages: pipeline stages ``S``.
        micro_batches: micro-batches ``M`` per step.
        chunks: model chunks per stage ``v``.
        actions: ``actions[s]`` is stage ``s``'s list.
    """

    name: str
    stages: int
    micro_batches: int
    chunks: int
    actions: tuple[tuple[Action, ...], ...]

    def __str__(self) -> str:
        return "\n".join(f"stage {s}: " + " ".join(map(str, acts))
                         for s, acts in enumerate(self.actions))

    def compute(self, stage: int) -> tuple[Action, ...]:
        """Stage ``stage``'s forwards and backwards only, in order."""
        return tuple(a for a in self.actions[stage] if a.is_compute)

    def neighbour(self, kind: str, stage: int, chunk: int) -> tuple[int, int] | None:
        """(stage, chunk) at the other end of a ``kind`` action of ``stage``'s ``chunk``: the
        next virtual stage for ``SEND_F``/``RECV_B``, the previous for ``RECV_F``/``SEND_B``;
        ``None`` past either end of the model."""
        vs = chunk * self.stages + stage + (1 if kind in ("SEND_F", "RECV_B") else -1)
        if not 0 <= vs < self.stages * self.chunks:
            return None
        return vs % self.stages, vs // self.stages


def _check(name: str, stages: int, micro_batches: int, chunks: int) -> None:
    Pipeline(stages, micro_batches, name, chunks)  # the layout's checks and messages
    if name == "interleaved-1f1b" and chunks > 1 and micro_batches % stages:
        raise ToolkitError(
            f"interleaved-1f1b needs micro-batches divisible by the stages: {micro_batches} "
            f"micro-batches, {stages} stages",
            f"use a multiple of {stages} micro-batches (Megatron-LM's constraint), e.g. "
            f"{stages * max(1, round(micro_batches / stages))}")


def _gpipe(s: int, S: int, M: int, v: int) -> list[tuple[str, int, int]]:
    return [("F", m, 0) for m in range(M)] + [("B", m, 0) for m in range(M)]


def _one_f_one_b(s: int, S: int, M: int, v: int) -> list[tuple[str, int, int]]:
    warmup = min(S - s - 1, M)
    order = [("F", m, 0) for m in range(warmup)]
    for i in range(M - warmup):
        order += [("F", warmup + i, 0), ("B", i, 0)]
    return order + [("B", m, 0) for m in range(M - warmup, M)]


def _interleaved(s: int, S: int, M: int, v: int) -> list[tuple[str, int, int]]:
    # Megatron-LM's forward_backward_pipelining_with_interleaving: the k-th forward runs local
    # chunk (k // S) % v on micro-batch (k // (S v)) S + k % S; backwards take chunks in reverse.
    if v == 1:  # one chunk: plain 1F1B (Megatron-LM runs its non-interleaved schedule then)
        return _one_f_one_b(s, S, M, v)
    total = M * v

    def action(kind: str, k: int) -> tuple[str, int, int]:
        chunk = (k // S) % v
        return kind, (k // (S * v)) * S + k % S, chunk if kind == "F" else v - 1 - chunk

    warmup = total if M == S else min((S - s - 1) * 2 + (v - 1) * S, total)
    order = [action("F", k) for k in range(warmup)]
    for i in range(total - warmup):
        order += [action("F", warmup + i), action("B", i)]
    return order + [action("B", k) for k in range(total - warmup, total)]


_ORDERS = {"gpipe": _gpipe, "1f1b": _one_f_one_b, "interleaved-1f1b": _interleaved}


def _reference_run(name, S, M, v, orders):
    """Start and end of every compute of ``orders`` (stage -> [(kind, m, chunk)]) with forward
    1 and backward 2, messages free and instant; a ToolkitError if the order cannot finish."""
    V = S * v
    done: dict[tuple[str, int, int], float] = {}  # (kind, m, virtual stage) -> end
    times: dict[tuple[int, int], tuple[float, float]] = {}
    pos, clock = [0] * S, [0.0] * S
    progress = True
    while progress:
        progress = False
        for s in range(S):
            while pos[s] < len(orders[s]):
                kind, m, c = orders[s][pos[s]]
                vs = c * S + s
                dep = (("F", m, vs - 1) if vs else None) if kind == "F" else (
                    ("B", m, vs + 1) if vs < V - 1 else ("F", m, vs))
                if dep is not None and dep not in done:
                    break
                start = max(clock[s], done[dep] if dep else 0.0)
                clock[s] = done[(kind, m, vs)] = start + (1.0 if kind == "F" else 2.0)
                times[(s, pos[s])] = (start, clock[s])
                pos[s] += 1
                progress = True
    stuck = [f"stage {s} at {orders[s][pos[s]]}" for s in range(S) if pos[s] < len(orders[s])]
    if stuck:
        raise ToolkitError(f"the {name} order cannot finish: {', '.join(stuck)}",
                           "a forward needs the previous stage's, a backward the next's")
    return times


def _with_messages(name: str, S: int, M: int, v: int, orders) -> Schedule:
    """The schedule ``orders`` (compute only) with every send and receive placed."""
    times = _reference_run(name, S, M, v, orders)
    skeleton = Schedule(name, S, M, v, ())
    start_of = {(kind, m, c * S + s): times[(s, i)][0]
                for s in range(S) for i, (kind, m, c) in enumerate(orders[s])}
    # Integer times strictly inside a compute (reference times are whole units).
    busy = [{t for b, e in (times[(s, i)] for i in range(len(orders[s])))
             for t in range(int(b) + 1, int(e))} for s in range(S)]
    events: list[list[tuple]] = [[] for _ in range(S)]
    for s in range(S):
        for i, (kind, m, c) in enumerate(orders[s]):
            start, end = times[(s, i)]
            events[s].append(((start, 1, i), Action(kind, m, c)))
            send = "SEND_F" if kind == "F" else "SEND_B"
            other = skeleton.neighbour(send, s, c)
            if other is None or other[0] == s:  # model's end, or the same rank: no message
                continue
            peer, peer_chunk = other
            # The message may pass at any time between its producer's end and its consumer's
            # start; the first time both stages are between computes lets even a rendezvous
            # pass without stalling either. When there is none, the producer's end: a buffered
            # send still never stalls, a rendezvous waits for the receiver's compute to end.
            need = start_of[(kind, m, peer_chunk * S + peer)]
            at = next((t for t in range(int(end), int(need) + 1)
                       if t not in busy[s] and t not in busy[peer]), end)
            # One global key per message (its time, then a fixed tie-break) on both ends.
            key = (at, 0, kind == "B", m, c * S + s)
            events[s].append((key, Action(send, m, c, peer)))
            events[peer].append((key, Action("RECV" + send[4:], m, peer_chunk, s)))
    actions = tuple(tuple(a for _, a in sorted(ev, key=lambda e: e[0])) for ev in events)
    return Schedule(name, S, M, v, actions)


def pipeline_schedule(name: str, stages: int, micro_batches: int, chunks: int = 1) -> Schedule:
    """The named schedule's actions for ``stages`` stages and ``micro_batches`` micro-batches.

    Args:
        name: ``gpipe`` (all forwards, then all backwards), ``1f1b`` (PipeDream-flush: stage
            ``s`` runs ``S-s-1`` warm-up forwards, then one forward one backward, then the
            remaining backwards) or ``interleaved-1f1b`` (Megatron-LM's schedule over ``chunks``
            model chunks per stage; micro-batches must be a multiple of the stages).
        stages: pipeline stages ``S``.
        micro_batches: micro-batches ``M`` per step.
        chunks: model chunks per stage ``v`` (``interleaved-1f1b`` only).

    Example:
        >>> print(pipeline_schedule("1f1b", 2, 3))
        stage 0: F0 SEND_F0 F1 SEND_F1 RECV_B0 B0 F2 SEND_F2 RECV_B1 B1 RECV_B2 B2
        stage 1: RECV_F0 F0 RECV_F1 B0 SEND_B0 F1 B1 RECV_F2 SEND_B1 F2 B2 SEND_B2
    """
    if name not in SCHEDULES:
        raise ToolkitError(f"unknown pipeline schedule {name!r}",
                           f"use one of: {', '.join(SCHEDULES)}")
    _check(name, stages, micro_batches, chunks)
    order = _ORDERS[name]
    orders = [order(s, stages, micro_batches, chunks) for s in range(stages)]
    return _with_messages(name, stages, micro_batches, chunks, orders)


def bubble_formula(name: str, stages: int, micro_batches: int, chunks: int = 1
                   ) -> tuple[str, float]:
    """The textbook idle fraction of a schedule with equal stage times: idle time over the
    stages' whole time, ``(S-1)/(M+S-1)`` for GPipe and 1F1B and ``(S-1)/(v M + S-1)`` for
    interleaved 1F1B (the same as Megatron-LM's bubble over ideal compute, ``(S-1)/(v M)``).
    Returns the formula's text and its value."""
    S, M, v = stages, micro_batches, chunks if name == "interleaved-1f1b" else 1
    if v > 1:
        return "(S-1)/(v*M+S-1)", (S - 1) / (v * M + S - 1)
    return "(S-1)/(M+S-1)", (S - 1) / (M + S - 1)
