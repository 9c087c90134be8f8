"""Pipeline schedules as data: generators, validator and simulator against the textbook formulas."""

from __future__ import annotations

import dataclasses

import pytest

from toolkit.errors import ToolkitError
from toolkit.parallel.pipeline.schedules import (
    Action,
    Schedule,
    _with_messages,
    bubble_formula,
    pipeline_schedule,
)
from toolkit.parallel.pipeline.simulation import (
    peak_activations,
    simulate_schedule,
    validate_schedule,
)

GRID = [(s, m) for s in (1, 2, 3, 4, 8) for m in (1, 2, 3, 4, 8, 16)]
INTERLEAVED = [(s, v, k * s) for s in (2, 3, 4, 8) for v in (2, 3, 4) for k in (1, 2, 4)]


def _compute_order(schedule: Schedule, stage: int) -> str:
    return " ".join(map(str, schedule.compute(stage)))


@pytest.mark.parametrize("text", ["F3", "B0", "F3.c1", "SEND_F3", "RECV_F0.c2", "SEND_B12",
                                  "RECV_B7.c1"])
def test_action_text_round_trips(text):
    assert str(Action.parse(text)) == text


def test_action_fields_and_bad_text():
    assert Action.parse("RECV_B7.c1") == Action("RECV_B", 7, 1)
    assert Action("F", 3, 0).is_compute and not Action("SEND_F", 3).is_compute
    with pytest.raises(ToolkitError, match="'X3' is not a pipeline action"):
        Action.parse("X3")


@pytest.mark.parametrize("stages, micro", GRID)
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_generated_schedules_validate(name, stages, micro):
    schedule = pipeline_schedule(name, stages, micro)
    validate_schedule(schedule)
    assert len(schedule.actions) == stages
    for s in range(stages):
        # Every stage forwards and backwards each micro-batch once; the ends never talk outward.
        assert sorted(map(str, schedule.compute(s))) == sorted(
            [f"F{m}" for m in range(micro)] + [f"B{m}" for m in range(micro)])
        kinds = {a.kind for a in schedule.actions[s]}
        assert ("RECV_F" in kinds) == ("SEND_B" in kinds) == (s > 0)
        assert ("SEND_F" in kinds) == ("RECV_B" in kinds) == (s < stages - 1)


@pytest.mark.parametrize("stages, chunks, micro", INTERLEAVED)
def test_interleaved_schedules_validate(stages, chunks, micro):
    schedule = pipeline_schedule("interleaved-1f1b", stages, micro, chunks)
    validate_schedule(schedule)
    for s in range(stages):
        assert len(schedule.compute(s)) == 2 * micro * chunks


def test_compute_orders_are_the_textbook_ones():
    gpipe = pipeline_schedule("gpipe", 3, 4)
    assert _compute_order(gpipe, 1) == "F0 F1 F2 F3 B0 B1 B2 B3"
    one = pipeline_schedule("1f1b", 4, 8)
    # S-s-1 warm-up forwards, then one forward one backward, then the cool-down backwards.
    assert _compute_order(one, 0) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7"
    assert _compute_order(one, 2) == "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7"
    assert _compute_order(one, 3) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7"
    inter = pipeline_schedule("interleaved-1f1b", 2, 4, 2)
    # Megatron-LM: rank 1 warms up (S-s-1)*2 + (v-1)*S = 2 forwards, groups of S micro-batches.
    assert _compute_order(inter, 1) == (
        "F0 F1 F0.c1 B0.c1 F1.c1 B1.c1 F2 B0 F3 B1 F2.c1 B2.c1 F3.c1 B3.c1 B2 B3")
    # One chunk per stage: Megatron-LM's plain 1F1B, any number of micro-batches.
    assert pipeline_schedule("interleaved-1f1b", 3, 5).actions == pipeline_schedule(
        "1f1b", 3, 5).actions
    assert str(pipeline_schedule("1f1b", 2, 2)) == (
        "stage 0: F0 SEND_F0 F1 SEND_F1 RECV_B0 B0 RECV_B1 B1\n"
        "stage 1: RECV_F0 F0 RECV_F1 B0 SEND_B0 F1 B1 SEND_B1")


def test_sends_name_their_peer():
    schedule = pipeline_schedule("interleaved-1f1b", 3, 3, 2)
    for s, actions in enumerate(schedule.actions):
        for a in actions:
            if not a.is_compute:
                assert a.peer == schedule.neighbour(a.kind, s, a.chunk)[0]
    # Stage 2's chunk 0 (virtual stage 2) sends to stage 0's chunk 1 (virtual stage 3).
    assert schedule.neighbour("SEND_F", 2, 0) == (0, 1)
    assert schedule.neighbour("SEND_F", 2, 1) is None


@pytest.mark.parametrize("stages, micro", GRID)
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("blocking", [False, True])
def test_gpipe_and_1f1b_bubble_is_the_formula(name, stages, micro, blocking):
    """Idle fraction = idle / (S x makespan) = (S-1)/(M+S-1), equal stages, backward = 2 x
    forward, free messages; under buffered and under blocking (rendezvous) sends."""
    sim = simulate_schedule(pipeline_schedule(name, stages, micro), blocking=blocking)
    assert sim.idle_fraction == pytest.approx((stages - 1) / (micro + stages - 1), abs=1e-12)
    assert sim.bubble_ratio == pytest.approx((stages - 1) / micro, abs=1e-12)
    assert sim.makespan == pytest.approx((micro + stages - 1) * 3.0)
    assert bubble_formula(name, stages, micro)[1] == pytest.approx(sim.idle_fraction)


@pytest.mark.parametrize("stages, chunks, micro", INTERLEAVED)
def test_interleaved_bubble_is_the_formula(stages, chunks, micro):
    """Megatron-LM's bubble over ideal compute time, (S-1)/(v M), tested as ``bubble_ratio``
    (idle time / compute time); the idle fraction of the step is then (S-1)/(v M + S-1)."""
    schedule = pipeline_schedule("interleaved-1f1b", stages, micro, chunks)
    sim = simulate_schedule(schedule, forward=1.0, backward=2.0)
    assert sim.bubble_ratio == pytest.approx((stages - 1) / (chunks * micro), abs=1e-12)
    assert sim.idle_fraction == pytest.approx(
        (stages - 1) / (chunks * micro + stages - 1), abs=1e-12)
    assert bubble_formula("interleaved-1f1b", stages, micro, chunks)[1] == pytest.approx(
        sim.idle_fraction)
    # A rendezvous can only add waiting; it never beats buffered sends.
    blocking = simulate_schedule(schedule, blocking=True)
    assert blocking.idle_fraction >= sim.idle_fraction - 1e-12


def test_interleaving_shrinks_the_bubble():
    plain = simulate_schedule(pipeline_schedule("1f1b", 4, 8)).idle_fraction
    inter = simulate_schedule(pipeline_schedule("interleaved-1f1b", 4, 8, 2)).idle_fraction
    assert plain == pytest.approx(3 / 11) and inter == pytest.approx(3 / 19)


@pytest.mark.parametrize("stages, micro", GRID)
def test_peak_activations(stages, micro):
    assert peak_activations(pipeline_schedule("gpipe", stages, micro)) == (micro,) * stages
    assert peak_activations(pipeline_schedule("1f1b", stages, micro)) == tuple(
        min(stages - s, micro) for s in range(stages))


@pytest.mark.parametrize("stages, chunks, micro", INTERLEAVED)
def test_interleaved_peak_activations_are_megatrons_warmup_plus_one(stages, chunks, micro):
    sim = simulate_schedule(pipeline_schedule("interleaved-1f1b", stages, micro, chunks))
    expected = tuple(micro * chunks if micro == stages else
                     min((stages - s - 1) * 2 + (chunks - 1) * stages + 1, micro * chunks)
                     for s in range(stages))
    assert sim.peak_activations == expected


def test_unequal_stage_times_and_message_time_by_hand():
    schedule = pipeline_schedule("gpipe", 2, 2)
    # Stage 1 three times slower. Stage 1: F0 1-4, F1 4-7, B0 7-13, B1 13-19; stage 0's
    # backwards wait for them: B0 13-15, B1 19-21.
    sim = simulate_schedule(schedule, forward=(1, 3), backward=(2, 6))
    assert sim.makespan == 21
    assert sim.idle_fraction == pytest.approx(1 - 24 / 42)
    b = {str(a): (s0, e0) for a, s0, e0 in zip(schedule.actions[0], sim.starts[0], sim.ends[0],
                                                strict=True)}
    assert b["B0"] == (13, 15) and b["B1"] == (19, 21)
    # Messages taking 0.5, buffered: each arrives 0.5 after its send.
    assert simulate_schedule(schedule, (1, 3), (2, 6), comm=0.5).makespan == 22
    # Rendezvous: a send waits for its receive; stage 1 reaches RECV_F1 only at 4.5.
    assert simulate_schedule(schedule, (1, 3), (2, 6), comm=0.5, blocking=True).makespan == 23


def test_simulation_records_cover_every_action():
    schedule = pipeline_schedule("1f1b", 3, 4)
    records = simulate_schedule(schedule).records(replica=1, step=5)
    assert len(records) == sum(len(a) for a in schedule.actions)
    assert {r["replica"] for r in records} == {1} and {r["step"] for r in records} == {5}
    assert all(r["end"] >= r["start"] for r in records)


def _edit(schedule: Schedule, stage: int, actions: list[str]) -> Schedule:
    """``schedule`` with stage ``stage``'s list replaced (peers left out)."""
    acts = list(schedule.actions)
    acts[stage] = tuple(Action.parse(a) for a in actions)
    return dataclasses.replace(schedule, actions=tuple(acts))


@pytest.mark.parametrize("stage, actions, words", [
    (1, "RECV_F0 F0 F1 B0 SEND_B0 B1 SEND_B1", "stage 1: F1 has no RECV_F1 before it"),
    (1, "RECV_F0 F0 RECV_F1 B0 SEND_B0 F1 B1", "stage 1: B1 has no SEND_B1 after it"),
    (0, "F0 SEND_F0 F1 RECV_B0 B0 RECV_B1 B1", "stage 0: F1 has no SEND_F1 after it"),
    (1, "RECV_F0 F0 RECV_F1 B1 SEND_B1 F1 B0 SEND_B0", "stage 1: B1 has no F1 before it"),
    (1, "RECV_F0 F0 RECV_F1 F1 B0 SEND_B0", "stage 1: B1 is missing"),
    (1, "RECV_F0 F0 RECV_F1 F1 F1 B0 SEND_B0 B1 SEND_B1", "stage 1: F1 appears twice"),
    (1, "RECV_F0 F0 RECV_F1 F1 B0 SEND_B0 B1 SEND_B1 SEND_F1", "stage 1: SEND_F1 has no peer"),
    (1, "RECV_F0 F0 RECV_F2 F1 B0 SEND_B0 B1 SEND_B1", "RECV_F2 is outside micro-batches"),
])
def test_validator_names_stage_and_action(stage, actions, words):
    bad = _edit(pipeline_schedule("1f1b", 2, 2), stage, actions.split())
    with pytest.raises(ToolkitError) as err:
        validate_schedule(bad)
    assert words in str(err.value) and "HINT" in str(err.value)


def test_validator_finds_a_deadlock():
    # The naive 1F1B order: both stages send first, so under blocking sends each waits for
    # the other forever (what batched exchanges or the generated order avoid).
    schedule = pipeline_schedule("1f1b", 2, 2)
    schedule = _edit(schedule, 0, "F0 SEND_F0 F1 SEND_F1 RECV_B0 B0 RECV_B1 B1".split())
    schedule = _edit(schedule, 1, "RECV_F0 F0 B0 SEND_B0 RECV_F1 F1 B1 SEND_B1".split())
    with pytest.raises(ToolkitError) as err:
        validate_schedule(schedule)
    assert ("deadlocks: stage 0 waits at SEND_F1 for stage 1; stage 1 waits at SEND_B0 for "
            "stage 0") in str(err.value)
    # Buffered sends would get through it: the simulator only runs validated schedules.
    with pytest.raises(ToolkitError, match="deadlocks"):
        simulate_schedule(schedule)


def test_validator_checks_peers():
    schedule = pipeline_schedule("1f1b", 3, 2)
    acts = list(schedule.actions)
    acts[1] = tuple(dataclasses.replace(a, peer=0) if a.kind == "SEND_F" else a for a in acts[1])
    with pytest.raises(ToolkitError, match="stage 1: SEND_F0 names peer 0, but chunk 0's "
                                           "neighbour is stage 2"):
        validate_schedule(dataclasses.replace(schedule, actions=tuple(acts)))


@pytest.mark.parametrize("call, words", [
    (lambda: pipeline_schedule("zb-h1", 2, 4), ["unknown pipeline schedule 'zb-h1'", "gpipe"]),
    (lambda: pipeline_schedule("interleaved-1f1b", 4, 6, 2),
     ["6 micro-batches, 4 stages", "multiple of 4", "e.g. 8"]),
    (lambda: pipeline_schedule("1f1b", 2, 4, 2), ["chunks=2", "interleaved-1f1b"]),
    (lambda: pipeline_schedule("gpipe", 0, 4), ["stages=0"]),
    (lambda: simulate_schedule(pipeline_schedule("gpipe", 2, 2), forward=(1, 2, 3)),
     ["forward=(1, 2, 3)", "one per stage (2)"]),
    (lambda: simulate_schedule(pipeline_schedule("gpipe", 2, 2), comm=-1), ["comm=-1"]),
])
def test_bad_schedule_input_is_a_clear_error(call, words):
    with pytest.raises(ToolkitError) as err:
        call()
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize("call, message", [
    (lambda: Action.parse("X3"),
     "'X3' is not a pipeline action\nHINT: write e.g. F3, B3, F3.c1, SEND_F3, RECV_B2.c1"),
    (lambda: pipeline_schedule("zb-h1", 2, 4),
     "unknown pipeline schedule 'zb-h1'\nHINT: use one of: gpipe, 1f1b, interleaved-1f1b"),
    # the hint's example is the multiple of S nearest to M, and never 0
    (lambda: pipeline_schedule("interleaved-1f1b", 4, 6, 2),
     "interleaved-1f1b needs micro-batches divisible by the stages: 6 micro-batches, 4 stages"
     "\nHINT: use a multiple of 4 micro-batches (Megatron-LM's constraint), e.g. 8"),
    (lambda: pipeline_schedule("interleaved-1f1b", 4, 3, 2),
     "interleaved-1f1b needs micro-batches divisible by the stages: 3 micro-batches, 4 stages"
     "\nHINT: use a multiple of 4 micro-batches (Megatron-LM's constraint), e.g. 4"),
    (lambda: pipeline_schedule("interleaved-1f1b", 4, 1, 2),
     "interleaved-1f1b needs micro-batches divisible by the stages: 1 micro-batches, 4 stages"
     "\nHINT: use a multiple of 4 micro-batches (Megatron-LM's constraint), e.g. 4"),
    # a generator whose order cannot run (here: each stage's first backward before any
    # forward) is refused where each stage stops
    (lambda: _with_messages("1f1b", 2, 2, 1, [[("B", 0, 0), ("F", 0, 0)], [("B", 0, 0)]]),
     "the 1f1b order cannot finish: stage 0 at ('B', 0, 0), stage 1 at ('B', 0, 0)\n"
     "HINT: a forward needs the previous stage's, a backward the next's"),
])
def test_schedule_errors_say_what_was_wrong_and_what_to_do(call, message):
    with pytest.raises(ToolkitError) as err:
        call()
    assert str(err.value) == message


@pytest.mark.parametrize("name, stages, micro, chunks", [
    ("gpipe", 3, 4, 1), ("1f1b", 2, 5, 1), ("interleaved-1f1b", 4, 8, 2)])
def test_a_schedule_carries_its_name_and_sizes(name, stages, micro, chunks):
    schedule = pipeline_schedule(name, stages, micro, chunks)
    assert (schedule.name, schedule.stages, schedule.micro_batches, schedule.chunks) == (
        name, stages, micro, chunks)


def test_bubble_formula_text_and_its_chunks():
    assert bubble_formula("1f1b", 4, 8) == ("(S-1)/(M+S-1)", pytest.approx(3 / 11))
    assert bubble_formula("gpipe", 4, 8) == ("(S-1)/(M+S-1)", pytest.approx(3 / 11))
    assert bubble_formula("interleaved-1f1b", 4, 8, 2) == ("(S-1)/(v*M+S-1)",
                                                           pytest.approx(3 / 19))
    # chunks count for the interleaved schedule only; one chunk unless told
    assert bubble_formula("1f1b", 4, 8, 2) == bubble_formula("1f1b", 4, 8)
    assert bubble_formula("interleaved-1f1b", 4, 8) == bubble_formula("1f1b", 4, 8)


def test_the_docstring_example_is_what_pipeline_schedule_gives():
    assert str(pipeline_schedule("1f1b", 2, 3)) == (
        "stage 0: F0 SEND_F0 F1 SEND_F1 RECV_B0 B0 F2 SEND_F2 RECV_B1 B1 RECV_B2 B2\n"
        "stage 1: RECV_F0 F0 RECV_F1 B0 SEND_B0 F1 B1 RECV_F2 SEND_B1 F2 B2 SEND_B2")


@pytest.mark.parametrize("stages, chunks, micro", [c for c in INTERLEAVED if c[0] in (3, 4)])
def test_messages_pass_between_computes_so_a_rendezvous_costs_nothing(stages, chunks, micro):
    """Each message is placed at the first time both its stages are between computes: with 3
    or 4 stages the interleaved schedule always finds one, and blocking sends then take no
    longer than buffered ones (at 2 and 8 stages some messages find no such time)."""
    schedule = pipeline_schedule("interleaved-1f1b", stages, micro, chunks)
    assert simulate_schedule(schedule, blocking=True).makespan == pytest.approx(
        simulate_schedule(schedule).makespan)


def test_a_rendezvous_at_two_interleaved_stages_costs_one_time_unit():
    """At 2 stages both directions meet on the same two ranks and some messages find no time
    where both are between computes. As generated, 2 stages x 2 chunks x 4 micro-batches lose
    one time unit to a rendezvous (13.5 buffered, 14.5 blocking); a message that skipped a
    free time at the end of its window would cost another unit."""
    schedule = pipeline_schedule("interleaved-1f1b", 2, 4, 2)
    assert simulate_schedule(schedule).makespan == pytest.approx(13.5)
    assert simulate_schedule(schedule, blocking=True).makespan == pytest.approx(14.5)
