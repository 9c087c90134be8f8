"""Pipeline schedules run in lockstep rounds; the validator's and the timing's messages whole;
the simulator's records and timing rules."""

from __future__ import annotations

import dataclasses

import pytest

from toolkit.errors import ToolkitError
from toolkit.parallel.pipeline.schedules import (
    Action,
    Schedule,
    pipeline_schedule,
)
from toolkit.parallel.pipeline.simulation import (
    lockstep_idle_fraction,
    lockstep_rounds,
    peak_activations,
    simulate_schedule,
    validate_schedule,
)


@pytest.mark.parametrize("name, stages, micro, chunks", [
    ("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 3, 2, 1), ("interleaved-1f1b", 4, 8, 2),
    ("interleaved-1f1b", 2, 4, 3), ("gpipe", 1, 3, 1),
])
def test_lockstep_rounds_keep_every_stage_order(name, stages, micro, chunks):
    schedule = pipeline_schedule(name, stages, micro, chunks)
    rounds = lockstep_rounds(schedule)
    replay = [[] for _ in range(stages)]
    for r in rounds:
        assert len(r.compute) == stages
        for s, a in enumerate(r.compute):
            if a is not None:
                assert a.is_compute
                replay[s].append(a)
        for src, dst, send, recv in r.messages:
            assert send.kind.startswith("SEND") and recv.kind == "RECV" + send.kind[4:]
            assert (send.peer, recv.peer, send.micro_batch) == (dst, src, recv.micro_batch)
            replay[src].append(send)
            replay[dst].append(recv)
    assert [tuple(r) for r in replay] == list(schedule.actions)
    if chunks == 1:  # one round per forward and per backward: 2 (M + S - 1) rounds
        assert len(rounds) == 2 * (micro + stages - 1)


@pytest.mark.parametrize("stages, micro", [(s, m) for s in (1, 2, 3, 4) for m in (1, 2, 4, 8)])
def test_lockstep_execution_keeps_gpipe_and_two_stage_1f1b_bubbles(stages, micro):
    """Exchanges only after rounds that pass messages: with equal stages GPipe loses nothing
    to the rounds at any S; at two stages neither GPipe nor 1F1B does, even with unequal
    stages; 1F1B at S > 2 waits for the slowest stage of a round."""
    gpipe = pipeline_schedule("gpipe", stages, micro)
    assert lockstep_idle_fraction(gpipe) == pytest.approx(
        simulate_schedule(gpipe).idle_fraction)
    one_f = pipeline_schedule("1f1b", stages, micro)
    rounds = lockstep_idle_fraction(one_f)
    if stages <= 2:
        assert rounds == pytest.approx(simulate_schedule(one_f).idle_fraction)
        uneven = dict(forward=(1.0, 1.5)[:stages], backward=(2.0, 3.5)[:stages])
        for schedule in (gpipe, one_f):
            assert lockstep_idle_fraction(schedule, **uneven) == pytest.approx(
                simulate_schedule(schedule, **uneven).idle_fraction)
    elif micro >= stages:
        assert rounds > simulate_schedule(one_f).idle_fraction + 0.05


def test_lockstep_idle_fraction_by_hand():
    """GPipe, 2 stages, 1 micro-batch, F = 1, B = 2: rounds F0|-, -|F0, -|B0, B0|-: each stage
    busy 3 of 6 time units."""
    assert lockstep_idle_fraction(pipeline_schedule("gpipe", 2, 1)) == pytest.approx(0.5)
    # 1F1B at S = 4, M = 8, F = 1, B = 2. Without rounds: the published GPipe/1F1B bubble
    # (S-1)/(M+S-1) (Huang et al. 2019; Narayanan et al. 2021) = 3/11 = 0.273.
    one_f = pipeline_schedule("1f1b", 4, 8)
    assert simulate_schedule(one_f).idle_fraction == pytest.approx(3 / 11)
    # In rounds, counted by hand: 2 (M+S-1) = 22 rounds, all but the last passing messages, so
    # each lasts its longest compute. The first S = 4 rounds are the forward wave F0..F3 down
    # the pipeline (1 unit each); the last stage starts B0 in round 5 and from then on every
    # round up to the 22nd holds some stage's backward (2 units each): 4 x 1 + 18 x 2 = 40
    # units, in which each stage computes M (F + B) = 24: idle 1 - 24/40 = 0.4.
    assert lockstep_idle_fraction(one_f) == pytest.approx(1 - 24 / 40)


_FIX = "\nHINT: generate schedules with toolkit.pipeline_schedule, or fix the stage's action list"


def _without(schedule: Schedule, stage: int, action: str) -> Schedule:
    """``schedule`` with one action of stage ``stage`` removed."""
    acts = [list(a) for a in schedule.actions]
    del acts[stage][[str(a) for a in acts[stage]].index(action)]
    return dataclasses.replace(schedule, actions=tuple(map(tuple, acts)))


_ONE_STAGE_TWO_CHUNKS = Schedule("one stage", 1, 1, 2, ((
    Action("F", 0, 0), Action("F", 0, 1), Action("B", 0, 1), Action("B", 0, 0)),))


def _stage_list(stage: int, actions: list) -> Schedule:
    acts = list(pipeline_schedule("1f1b", 2, 2).actions)
    acts[stage] = tuple(actions)
    return dataclasses.replace(pipeline_schedule("1f1b", 2, 2), actions=tuple(acts))


@pytest.mark.parametrize("schedule, message", [
    ("abc", "'abc' is not a Schedule with one list per stage"),
    (dataclasses.replace(pipeline_schedule("gpipe", 2, 1), stages=3),
     "Schedule(name='gpipe', stages=3, micro_batches=1, chunks=1, actions=((Action(kin is not "
     "a Schedule with one list per stage"),
    (_stage_list(1, ["F0", *pipeline_schedule("1f1b", 2, 2).actions[1][1:]]),
     "stage 1: 'F0' is not an Action of kind F, B, SEND_F, RECV_F, SEND_B, RECV_B"),
    (_stage_list(0, [Action("X", 0), *pipeline_schedule("1f1b", 2, 2).actions[0][1:]]),
     "stage 0: Action(kind='X', micro_batch=0, chunk=0, peer=None) is not an Action of kind "
     "F, B, SEND_F, RECV_F, SEND_B, RECV_B"),
    (_stage_list(0, [*pipeline_schedule("1f1b", 2, 2).actions[0], Action("F", 0, 1)]),
     "stage 0: F0.c1 is outside micro-batches 0..1 / chunks 0..0"),
    (_stage_list(1, [*pipeline_schedule("1f1b", 2, 2).actions[1], Action("SEND_F", 1)]),
     "stage 1: SEND_F1 has no peer: the other end of chunk 0 is past the model's end"),
    (dataclasses.replace(_ONE_STAGE_TWO_CHUNKS, actions=((
        Action("F", 0, 0), Action("SEND_F", 0, 0), *_ONE_STAGE_TWO_CHUNKS.actions[0][1:]),)),
     "stage 0: SEND_F0 has no peer: the other end of chunk 0 is on the same stage"),
    (_without(pipeline_schedule("interleaved-1f1b", 2, 2, 2), 0, "B1.c1"),
     "stage 0: B1.c1 is missing: every micro-batch needs one forward and one backward on "
     "every chunk"),
    (_stage_list(1, [Action.parse(a) for a in "RECV_F0 F0 RECV_F1 B1 SEND_B1 F1 B0 SEND_B0"
                     .split()]), "stage 1: B1 has no F1 before it (a backward needs its forward)"),
    (_without(pipeline_schedule("interleaved-1f1b", 2, 2, 2), 0, "RECV_B0.c1"),
     "stage 0: B0.c1 has no RECV_B0.c1 before it (stage 1 sends it)"),
    (_without(pipeline_schedule("interleaved-1f1b", 2, 2, 2), 0, "SEND_B0.c1"),
     "stage 0: B0.c1 has no SEND_B0.c1 after it (stage 1 waits for it)"),
    (_without(pipeline_schedule("1f1b", 2, 2), 1, "SEND_B1"),
     "stage 1: B1 has no SEND_B1 after it (stage 0 waits for it)"),
    (_without(pipeline_schedule("1f1b", 2, 2), 0, "RECV_B0"),
     "stage 0: B0 has no RECV_B0 before it (stage 1 sends it)"),
    # one stage holding both chunks: chunk 1's forward follows chunk 0's, the backwards reverse
    (dataclasses.replace(_ONE_STAGE_TWO_CHUNKS, actions=((
        Action("F", 0, 1), Action("F", 0, 0), Action("B", 0, 1), Action("B", 0, 0)),)),
     "stage 0: F0.c1 has no F0 before it (same-stage chunk)"),
    (dataclasses.replace(_ONE_STAGE_TWO_CHUNKS, actions=((
        Action("F", 0, 0), Action("F", 0, 1), Action("B", 0, 0), Action("B", 0, 1)),)),
     "stage 0: B0 has no B0.c1 before it (same-stage chunk)"),
])
def test_validator_messages_whole(schedule, message):
    with pytest.raises(ToolkitError) as err:
        validate_schedule(schedule)
    assert str(err.value) == message + _FIX


def test_one_stage_with_two_chunks_validates():
    validate_schedule(_ONE_STAGE_TWO_CHUNKS)


def test_the_deadlock_message_whole():
    schedule = _stage_list(0, [Action.parse(a) for a in
                               "F0 SEND_F0 F1 SEND_F1 RECV_B0 B0 RECV_B1 B1".split()])
    acts = list(schedule.actions)
    acts[1] = tuple(Action.parse(a) for a in "RECV_F0 F0 B0 SEND_B0 RECV_F1 F1 B1 SEND_B1".split())
    with pytest.raises(ToolkitError) as err:
        validate_schedule(dataclasses.replace(schedule, actions=tuple(acts)))
    assert str(err.value) == (
        "the 1f1b schedule deadlocks: stage 0 waits at SEND_F1 for stage 1; stage 1 waits at "
        "SEND_B0 for stage 0\nHINT: order each pair of stages' sends and receives the same way")


@pytest.mark.parametrize("call, message", [
    (lambda s: lockstep_idle_fraction(s, forward=(1, 2, 3)),
     "forward=(1, 2, 3): need one non-negative time, or one per stage (2)\n"
     "HINT: e.g. forward=1.0"),
    (lambda s: lockstep_idle_fraction(s, backward=-1),
     "backward=-1: need one non-negative time, or one per stage (2)\nHINT: e.g. backward=1.0"),
    (lambda s: simulate_schedule(s, backward=-1),
     "backward=-1: need one non-negative time, or one per stage (2)\nHINT: e.g. backward=1.0"),
])
def test_time_errors_whole(call, message):
    with pytest.raises(ToolkitError) as err:
        call(pipeline_schedule("gpipe", 2, 2))
    assert str(err.value) == message


def test_a_rendezvous_starts_and_ends_a_message_on_both_stages_together():
    schedule = pipeline_schedule("gpipe", 2, 2)
    sim = simulate_schedule(schedule, (1, 3), (2, 6), comm=0.5, blocking=True)
    at = {(s, str(a)): (sim.starts[s][i], sim.ends[s][i])
          for s, acts in enumerate(schedule.actions) for i, a in enumerate(acts)}
    for (s, text), (start, end) in at.items():
        assert isinstance(start, float) and start <= end
        if text.startswith("SEND"):
            assert at[(1 - s, "RECV" + text[4:])] == (start, end) and end == start + 0.5
    assert at[(0, "SEND_F1")] == (4.5, 5.0)  # stage 1 reaches RECV_F1 only at 4.5


@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_a_chunk_takes_the_stage_time_over_the_chunks(chunks):
    """``forward``/``backward`` are a whole stage's times: every stage computes M (F + B) in
    all, however many chunks it holds."""
    schedule = pipeline_schedule("interleaved-1f1b", 2, 4, chunks)
    sim = simulate_schedule(schedule, forward=1.0, backward=2.5)
    assert sim.compute_time == pytest.approx(2 * 4 * 3.5)


def test_the_default_backward_is_twice_each_stages_forward():
    schedule = pipeline_schedule("1f1b", 2, 4)
    uneven = dict(forward=(1.0, 1.5))
    assert simulate_schedule(schedule, **uneven).makespan == simulate_schedule(
        schedule, backward=(2.0, 3.0), **uneven).makespan
    assert lockstep_idle_fraction(schedule, **uneven) == lockstep_idle_fraction(
        schedule, backward=(2.0, 3.0), **uneven)


def test_peak_activations_count_forwards_in_flight_in_any_order():
    schedule = Schedule("by hand", 1, 3, 1, (tuple(
        Action.parse(a) for a in "F0 B0 F1 F2 B1 B2".split()),))
    validate_schedule(schedule)
    assert peak_activations(schedule) == (2,)


def test_records_default_to_replica_0_and_step_0():
    records = simulate_schedule(pipeline_schedule("gpipe", 2, 2)).records()
    assert {r["replica"] for r in records} == {0} and {r["step"] for r in records} == {0}
