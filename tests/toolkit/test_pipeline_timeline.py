"""Measured pipeline timelines: the record format, StageRecorder and the drawing command."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit import StageRecorder, pipeline_schedule, read_timeline, simulate_schedule
from toolkit.errors import ToolkitError
from toolkit.parallel.pipeline.timeline import (
    action_seconds,
    idle_fraction,
    peak_in_flight,
    select,
    stage_times,
    write_timeline,
)
from toolkit.pipeline_timeline import main

ROOT = Path(__file__).resolve().parents[2]


class _Clock:
    """A clock that advances by the given steps, so recorded times are exact."""

    def __init__(self, *times):
        self.times = list(times)

    def __call__(self):
        return self.times.pop(0)


def test_stage_recorder_writes_the_record_format(tmp_path):
    rec = StageRecorder(stage=1, replica=2, origin=100.0, clock=_Clock(101.0, 101.5, 102.0, 103.0))
    with rec.action("F3.c1", step=4):
        pass
    with rec.action(pipeline_schedule("1f1b", 2, 4).actions[1][0]):  # an Action works too
        pass
    rec.add("B3.c1", 105.0, 106.5, step=4)
    path = tmp_path / "rank3.jsonl"
    rec.save(path)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0] == {"stage": 1, "replica": 2, "step": 4, "action": "F3.c1", "micro_batch": 3,
                        "chunk": 1, "start": 1.0, "end": 1.5}
    assert lines[1]["action"] == "RECV_F0" and (lines[1]["start"], lines[1]["end"]) == (2.0, 3.0)
    assert lines[2]["end"] - lines[2]["start"] == 1.5
    assert read_timeline([tmp_path]) == lines  # a folder reads every .jsonl in it


def test_a_failed_action_is_not_recorded():
    rec = StageRecorder(stage=0, clock=_Clock(1.0, 2.0))
    with pytest.raises(ValueError), rec.action("F0"):
        raise ValueError("boom")
    assert rec.records == []


def test_measured_idle_fraction_and_peaks_by_hand():
    # Two stages, one micro-batch: stage 0 busy 0-1 and 3-5, stage 1 busy 1-3 (span 5).
    records = [{"stage": 0, "replica": 0, "step": 0, "action": a, "micro_batch": 0, "chunk": 0,
                "start": b, "end": e} for a, b, e in (("F0", 0, 1), ("B0", 3, 5))]
    records += [{"stage": 1, "replica": 0, "step": 0, "action": a, "micro_batch": 0, "chunk": 0,
                 "start": b, "end": e} for a, b, e in (("RECV_F0", 0, 1), ("F0", 1, 2),
                                                        ("B0", 2, 3))]
    assert idle_fraction(records) == pytest.approx(1 - 5 / 10)
    assert peak_in_flight(records) == {0: 1, 1: 1}


def test_an_action_recorded_in_parts():
    """A backward whose gradient sums ran later, in a wait (horovod-tf): both parts count as
    compute, the action's time adds them up, and the backward frees its forward once."""
    rows = (("F0", 0, 1), ("F1", 1, 2), ("B0", 2, 3), ("F2", 3, 4), ("B0", 4, 4.5),
            ("F3", 4.5, 5.5), ("B1", 5.5, 6.5), ("B1", 7.5, 8))
    records = [{"stage": 0, "replica": 0, "step": 0, "action": a, "micro_batch": int(a[1]),
                "chunk": 0, "start": b, "end": e} for a, b, e in rows]
    assert idle_fraction(records) == pytest.approx(1 - 7 / 8)
    assert peak_in_flight(records) == {0: 3}  # F3 while F1, F2 are held (per part: 2)
    seconds = action_seconds(records)
    assert seconds[(0, "B0")] == pytest.approx(1.5) and seconds[(0, "B1")] == pytest.approx(1.5)
    assert stage_times(records, 1) == ([1.0], [1.5])  # per micro-batch, parts added
    assert seconds[(0, "F2")] == pytest.approx(1.0)


def test_select_picks_the_last_step_of_a_replica():
    sim = simulate_schedule(pipeline_schedule("1f1b", 2, 2))
    records = sim.records(0, 0) + sim.records(0, 1) + sim.records(1, 1)
    assert {r["step"] for r in select(records)} == {1}
    assert {r["replica"] for r in select(records, step=0)} == {0}
    with pytest.raises(ToolkitError, match="no records of step 7"):
        select(records, step=7)
    with pytest.raises(ToolkitError, match="no records of replica 3"):
        select(records, replica=3)


def test_bad_timeline_files_are_clear_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"stage": 0, "action": "F0"}\n')
    with pytest.raises(ToolkitError, match=r"bad.jsonl:1 is not a timeline record \(lacks "
                                           r"replica, micro_batch, chunk, start, end\)"):
        read_timeline([bad])
    with pytest.raises(ToolkitError, match="does not exist"):
        read_timeline([tmp_path / "missing.jsonl"])


def _fraction(out: str, what: str) -> float:
    return float(re.search(rf"idle fraction: {what} ([0-9.]+)", out).group(1))


def test_command_draws_a_simulated_record_file(tmp_path, capsys):
    sim = simulate_schedule(pipeline_schedule("1f1b", 4, 8))
    runs = tmp_path / "run"
    runs.mkdir()
    for s in range(4):  # one file per stage, as the ranks write them
        write_timeline([r for r in sim.records() if r["stage"] == s], runs / f"stage{s}.jsonl")
    png = tmp_path / "timeline.png"
    assert main([str(runs), "--png", str(png), "--schedule", "1f1b"]) == 0
    out = capsys.readouterr().out
    assert f"idle fraction: measured {sim.idle_fraction:.4f}," in out
    assert _fraction(out, "measured") == pytest.approx(3 / 11, abs=5e-5)
    assert "formula (S-1)/(M+S-1) = 0.2727" in out
    assert "peak in-flight activations per stage: 4 3 2 1" in out
    assert "simulated with the measured stage times: 0.2727" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_command_simulates_without_a_run(tmp_path):
    """``python -m toolkit.pipeline_timeline --simulate``, as a user runs it."""
    png, jsonl = tmp_path / "gpipe.png", tmp_path / "gpipe.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "toolkit.pipeline_timeline", "--simulate", "--schedule", "gpipe",
         "--stages", "2", "--micro-batches", "8", "--png", str(png), "--jsonl", str(jsonl)],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert _fraction(done.stdout, "simulated") == pytest.approx(1 / 9, abs=5e-5)
    assert "peak in-flight activations per stage: 8 8" in done.stdout
    assert png.stat().st_size > 10_000
    assert len(read_timeline([jsonl])) == sum(
        len(a) for a in pipeline_schedule("gpipe", 2, 8).actions)


def test_command_errors(tmp_path, capsys):
    assert main(["--simulate", "--schedule", "1f1b"]) == 2
    assert "--simulate needs --schedule, --stages and --micro-batches" in capsys.readouterr().err
    assert main([]) == 2
    assert "no timeline to show" in capsys.readouterr().err


@pytest.mark.parametrize("stages, micro, said", [
    (1, 1, "1 stage x 1 micro-batch,"), (2, 3, "2 stages x 3 micro-batches,")])
def test_command_counts_stages_and_micro_batches_in_agreement(capsys, stages, micro, said):
    assert main(["--simulate", "--schedule", "gpipe", "--stages", str(stages),
                 "--micro-batches", str(micro)]) == 0
    assert f"schedule gpipe: {said} replica 0" in capsys.readouterr().out
