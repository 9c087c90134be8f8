"""Checking and timing pipeline schedules without any framework.

``validate_schedule`` checks every dependency of a ``Schedule`` and runs it under blocking paired
sends and receives (a send and its receive complete together, when both stages have reached
them), so a schedule that validates cannot deadlock an executor with those semantics (nor one
with buffered sends). ``simulate_schedule`` runs it with given times and reports every action's
start and end, the idle (bubble) fraction and the peak number of in-flight activations.
``lockstep_rounds`` regroups a schedule for executors whose messages are collectives over the
whole pipeline rather than between two stages.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence

from toolkit.errors import ToolkitError
from toolkit.parallel.pipeline.schedules import KINDS, Action, Schedule

_HINT = "generate schedules with toolkit.pipeline_schedule, or fix the stage's action list"
_PAIR = {"SEND_F": "RECV_F", "RECV_F": "SEND_F", "SEND_B": "RECV_B", "RECV_B": "SEND_B"}


def _fail(stage: int, action: object, problem: str) -> ToolkitError:
    return ToolkitError(f"stage {stage}: {action} {problem}", _HINT)


def _check_stage(schedule: Schedule, s: int) -> None:
    M, v = schedule.micro_batches, schedule.chunks
    at: dict[tuple[str, int, int], int] = {}
    for i, a in enumerate(schedule.actions[s]):
        if not isinstance(a, Action) or a.kind not in KINDS:
            raise _fail(s, repr(a), f"is not an Action of kind {', '.join(KINDS)}")
        if not (0 <= a.micro_batch < M and 0 <= a.chunk < v):
            raise _fail(s, a, f"is outside micro-batches 0..{M - 1} / chunks 0..{v - 1}")
        key = (a.kind, a.micro_batch, a.chunk)
        if key in at:
            raise _fail(s, a, f"appears twice (positions {at[key]} and {i})")
        at[key] = i
        if not a.is_compute:
            other = schedule.neighbour(a.kind, s, a.chunk)
            if other is None or other[0] == s:
                where = "past the model's end" if other is None else "on the same stage"
                raise _fail(s, a, f"has no peer: the other end of chunk {a.chunk} is {where}")
            if a.peer is not None and a.peer != other[0]:
                raise _fail(s, a, f"names peer {a.peer}, but chunk {a.chunk}'s neighbour "
                            f"is stage {other[0]}")

    def need(key, before: bool, of: tuple[str, int, int], why: str) -> None:
        j = at.get(key)
        shown = f"{key[0]}{key[1]}" + (f".c{key[2]}" if key[2] else "")
        if j is None or (j > at[of] if before else j < at[of]):
            raise _fail(s, Action(*of), f"has no {shown} {'before' if before else 'after'} "
                        f"it ({why})")

    for c in range(v):
        for m in range(M):
            for kind in ("F", "B"):
                if (kind, m, c) not in at:
                    raise _fail(s, Action(kind, m, c), "is missing: every micro-batch needs "
                                "one forward and one backward on every chunk")
            f, b = ("F", m, c), ("B", m, c)
            need(f, True, b, "a backward needs its forward")
            prev, nxt = schedule.neighbour("RECV_F", s, c), schedule.neighbour("SEND_F", s, c)
            for other, recv, send, consumer, producer in (
                    (prev, "RECV_F", "SEND_B", f, b), (nxt, "RECV_B", "SEND_F", b, f)):
                if other is None:
                    continue
                if other[0] == s:  # the neighbouring chunk is local: it must have run first
                    need((consumer[0], m, other[1]), True, consumer, "same-stage chunk")
                else:
                    need((recv, m, c), True, consumer, f"stage {other[0]} sends it")
                    need((send, m, c), False, producer, f"stage {other[0]} waits for it")


def peak_activations(schedule: Schedule) -> tuple[int, ...]:
    """Per stage, the most forwards (micro-batch chunks) whose backward has not yet run."""
    peaks = []
    for s in range(schedule.stages):
        live = peak = 0
        for a in schedule.compute(s):
            live += 1 if a.kind == "F" else -1
            peak = max(peak, live)
        peaks.append(peak)
    return tuple(peaks)


def _run(schedule: Schedule, duration, comm: float, blocking: bool):
    """Runs every stage's list; (starts, ends) per stage, and the stages still blocked (with
    their action) when no stage can move. ``blocking``: a send and its receive complete
    together once both stages reach them (a rendezvous); else a send returns at once and its
    message arrives ``comm`` later, a receive waits for it."""
    S = schedule.stages
    acts = schedule.actions
    starts = [[0.0] * len(a) for a in acts]
    ends = [[0.0] * len(a) for a in acts]
    pos, clock = [0] * S, [0.0] * S
    arrivals: dict[tuple[int, str, int, int], float] = {}  # (stage, RECV_x, m, chunk) -> time

    def advance(stage: int, start: float, end: float) -> None:
        starts[stage][pos[stage]], ends[stage][pos[stage]] = start, end
        clock[stage] = end
        pos[stage] += 1

    progress = True
    while progress:
        progress = False
        for s in range(S):
            while pos[s] < len(acts[s]):
                a = acts[s][pos[s]]
                if a.is_compute:
                    advance(s, clock[s], clock[s] + duration(s, a))
                elif not blocking:
                    if a.kind.startswith("SEND"):
                        peer, peer_chunk = schedule.neighbour(a.kind, s, a.chunk)
                        arrivals[(peer, _PAIR[a.kind], a.micro_batch, peer_chunk)] = (
                            clock[s] + comm)
                        advance(s, clock[s], clock[s])
                    elif (s, a.kind, a.micro_batch, a.chunk) in arrivals:
                        arrived = arrivals[(s, a.kind, a.micro_batch, a.chunk)]
                        advance(s, clock[s], max(clock[s], arrived))
                    else:
                        break
                else:
                    peer, peer_chunk = schedule.neighbour(a.kind, s, a.chunk)
                    b = acts[peer][pos[peer]] if pos[peer] < len(acts[peer]) else None
                    if b is None or (b.kind, b.micro_batch, b.chunk) != (
                            _PAIR[a.kind], a.micro_batch, peer_chunk):
                        break
                    start = max(clock[s], clock[peer])
                    advance(s, start, start + comm)
                    advance(peer, start, start + comm)
                progress = True
    blocked = [(s, acts[s][pos[s]]) for s in range(S) if pos[s] < len(acts[s])]
    return starts, ends, blocked


def validate_schedule(schedule: Schedule) -> None:
    """Raises a ToolkitError naming the stage and the action when ``schedule`` is wrong.

    Checks, for every stage and chunk: each micro-batch forwarded and backwarded exactly once;
    every forward before its backward; a forward that needs another stage's activations preceded
    by its ``RECV_F`` (and the sender's ``F`` followed by the matching ``SEND_F``); a backward
    that needs another stage's gradient preceded by its ``RECV_B`` (and the sender's ``SEND_B``
    after its ``B``); no send or receive without a peer; and that all stages run to the end when
    each send and receive blocks until its pair is reached (no deadlock).
    """
    if not isinstance(schedule, Schedule) or len(schedule.actions) != schedule.stages:
        raise ToolkitError(f"{schedule!r:.80} is not a Schedule with one list per stage", _HINT)
    for s in range(schedule.stages):
        _check_stage(schedule, s)
    *_, blocked = _run(schedule, lambda s, a: 1.0, 0.0, blocking=True)
    if blocked:
        waits = "; ".join(
            f"stage {s} waits at {a} for stage {schedule.neighbour(a.kind, s, a.chunk)[0]}"
            for s, a in blocked)
        raise ToolkitError(f"the {schedule.name} schedule deadlocks: {waits}",
                           "order each pair of stages' sends and receives the same way")


@dataclasses.dataclass(frozen=True)
class LockstepRound:
    """One lockstep round: each stage runs at most one compute, then the round's messages move.

    Attributes:
        compute: per stage, its forward or backward this round (``None``: idle).
        messages: ``(sender, receiver, SEND action, RECV action)`` for every message passed
            after the computes, in the order each stage meets them.
    """

    compute: tuple[Action | None, ...]
    messages: tuple[tuple[int, int, Action, Action], ...]


def lockstep_rounds(schedule: Schedule) -> tuple[LockstepRound, ...]:
    """``schedule`` regrouped into rounds every stage runs together, for executors whose
    messages are collectives over the whole pipeline (one ``alltoall`` or a pair of
    ``ppermute`` shifts per round, issued by every stage in the same order).

    Each stage's actions keep their order; a round takes each stage's next action if it is a
    compute, then every send whose receive is also next in line (repeatedly, so a stage may pass
    several messages in one round). A validated schedule always makes progress.

    Example:
        >>> from toolkit import pipeline_schedule
        >>> rounds = lockstep_rounds(pipeline_schedule("gpipe", 2, 1))
        >>> [[str(a) for a in r.compute] for r in rounds]
        [['F0', 'None'], ['None', 'F0'], ['None', 'B0'], ['B0', 'None']]
    """
    validate_schedule(schedule)
    acts, S = schedule.actions, schedule.stages
    pos = [0] * S

    def head(s: int) -> Action | None:
        return acts[s][pos[s]] if pos[s] < len(acts[s]) else None

    rounds = []
    while any(head(s) is not None for s in range(S)):
        compute = []
        for s in range(S):
            a = head(s)
            compute.append(a if a is not None and a.is_compute else None)
            pos[s] += compute[-1] is not None
        messages, moved = [], True
        while moved:
            moved = False
            for s in range(S):
                a = head(s)
                if a is None or not a.kind.startswith("SEND"):
                    continue
                peer, peer_chunk = schedule.neighbour(a.kind, s, a.chunk)
                b = head(peer)
                if b is not None and (b.kind, b.micro_batch, b.chunk) == (
                        _PAIR[a.kind], a.micro_batch, peer_chunk):
                    messages.append((s, peer, a, b))
                    pos[s] += 1
                    pos[peer] += 1
                    moved = True
        rounds.append(LockstepRound(tuple(compute), tuple(messages)))
    return tuple(rounds)


def _per_stage(name: str, value, stages: int) -> tuple[float, ...]:
    values = (value,) * stages if isinstance(value, numbers.Real) else tuple(value)
    if len(values) != stages or any(not isinstance(t, numbers.Real) or t < 0 for t in values):
        raise ToolkitError(f"{name}={value!r}: need one non-negative time, or one per stage "
                           f"({stages})", f"e.g. {name}=1.0")
    return tuple(float(t) for t in values)


@dataclasses.dataclass(frozen=True)
class Simulation:
    """A schedule's simulated run.

    Attributes:
        schedule: the schedule run.
        starts: ``starts[s][i]``: when stage ``s``'s ``i``-th action started.
        ends: when it ended.
        peak_activations: per stage, the most forwards whose backward had not run.
    """

    schedule: Schedule
    starts: tuple[tuple[float, ...], ...]
    ends: tuple[tuple[float, ...], ...]
    peak_activations: tuple[int, ...]

    @property
    def makespan(self) -> float:
        return max(max(e, default=0.0) for e in self.ends)

    @property
    def compute_time(self) -> float:
        """Time all stages spent in forwards and backwards, summed."""
        return sum(e - b for acts, st, en in zip(self.schedule.actions, self.starts, self.ends,
                                                strict=True)
                   for a, b, e in zip(acts, st, en, strict=True) if a.is_compute)

    @property
    def idle_fraction(self) -> float:
        """Idle time (waiting, sending, receiving) over ``stages x makespan``: the bubble as a
        fraction of the step, ``(S-1)/(M+S-1)`` for GPipe and 1F1B with equal stage times."""
        total = self.schedule.stages * self.makespan
        return 1.0 - self.compute_time / total if total else 0.0

    @property
    def bubble_ratio(self) -> float:
        """Idle time over compute time (Megatron-LM's bubble over ideal compute time):
        ``(S-1)/M`` for GPipe and 1F1B, ``(S-1)/(v M)`` for interleaved 1F1B."""
        busy = self.compute_time
        return self.schedule.stages * self.makespan / busy - 1.0 if busy else 0.0

    def records(self, replica: int = 0, step: int = 0) -> list[dict]:
        """The run as timeline records (the format ``StageRecorder`` writes)."""
        from toolkit.parallel.pipeline.timeline import record

        return [record(s, replica, a, b, e, step)
                for s, (acts, st, en) in enumerate(zip(self.schedule.actions, self.starts,
                                                       self.ends, strict=True))
                for a, b, e in zip(acts, st, en, strict=True)]


def simulate_schedule(schedule: Schedule, forward: float | Sequence[float] = 1.0,
                      backward: float | Sequence[float] | None = None,
                      comm: float = 0.0, blocking: bool = False) -> Simulation:
    """Times ``schedule`` with blocking paired sends and receives.

    Args:
        schedule: a validated schedule.
        forward: one micro-batch's forward time through a whole stage (all its chunks), or one
            per stage; a chunk takes ``forward / chunks``.
        backward: the same for the backward; default twice the forward.
        comm: the time a message takes from its send to its receive.
        blocking: ``False`` (default): a send returns at once (an asynchronous send, what
            torch's ``isend``, Megatron-LM's batched exchanges and Horovod's async ops give);
            ``True``: a send and its receive start together once both stages reach them and
            both take ``comm`` (a rendezvous, e.g. a blocking broadcast in a 2-rank group).

    Example:
        >>> from toolkit import pipeline_schedule
        >>> round(simulate_schedule(pipeline_schedule("1f1b", 4, 8)).idle_fraction, 4)
        0.2727
    """
    validate_schedule(schedule)
    S, v = schedule.stages, schedule.chunks
    f = _per_stage("forward", forward, S)
    b = _per_stage("backward", tuple(2 * t for t in f) if backward is None else backward, S)
    comm = _per_stage("comm", comm, 1)[0]
    starts, ends, _ = _run(schedule, lambda s, a: (f if a.kind == "F" else b)[s] / v, comm,
                           blocking)
    return Simulation(schedule, tuple(map(tuple, starts)), tuple(map(tuple, ends)),
                      peak_activations(schedule))


def lockstep_idle_fraction(schedule: Schedule, forward: float | Sequence[float] = 1.0,
                           backward: float | Sequence[float] | None = None) -> float:
    """The idle fraction of ``schedule`` as the toolkit's executors run it: its
    ``lockstep_rounds``, each stage's computes back to back, and after every round that passes
    messages one exchange over the whole pipeline that every stage waits for (an ``alltoall``
    or a ``ppermute`` wave; rounds without messages pass no barrier). Messages take no time.
    ``forward``/``backward`` as in ``simulate_schedule``.

    Equal to ``simulate_schedule``'s (the formula) for GPipe at any S with equal stages, and
    for GPipe and 1F1B at S = 2 with any stage times; higher where a round's exchange makes a
    stage wait for another's longer compute (1F1B at S > 2, interleaving, unequal stages at
    S > 2). Exact for horovod-tf's executor (horovod-torch's starts each round's alltoall
    asynchronously and waits only for a message it needs: ``simulate_schedule``'s
    ``blocking=False``); the JAX ones also wait on the host for each round's compute, which
    matters only when one process holds several stages.

    Example:
        >>> from toolkit import pipeline_schedule
        >>> round(lockstep_idle_fraction(pipeline_schedule("1f1b", 2, 8)), 4)
        0.1111
    """
    S, v = schedule.stages, schedule.chunks
    f = _per_stage("forward", forward, S)
    b = _per_stage("backward", tuple(2 * t for t in f) if backward is None else backward, S)
    clock, busy = [0.0] * S, 0.0
    for rnd in lockstep_rounds(schedule):
        for s, a in enumerate(rnd.compute):
            if a is not None:
                took = (f if a.kind == "F" else b)[s] / v
                clock[s] += took
                busy += took
        if rnd.messages:
            clock = [max(clock)] * S
    total = S * max(clock)
    return 1.0 - busy / total if total else 0.0
