"""horovodrun passes the signal it receives on to the ranks and exits with their status; a
second signal arriving while it handles the first (a double Ctrl-C, Slurm's SIGTERM beside a
user's Ctrl-C) changes nothing: the ranks stop at a step with a checkpoint, and horovodrun is
gone within the stop timeout, every time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

STOP_TIMEOUT = 30.0  # seconds from the signal until horovodrun must be gone (it takes < 1 s)
REPEATS = 4  # the race of the shell's exit with the stop: test_horovod_runner_patch.py


def _stop_once(start, tmp: Path, signals: list[signal.Signals], gap: float
               ) -> tuple[int, dict, str]:
    """Starts 2 ranks under horovodrun --gloo, waits for training, sends ``signals`` to
    horovodrun ``gap`` seconds apart; returns its status, the ranks' stop record and output."""
    metrics = tmp / "metrics.jsonl"
    argv = ["examples/train_digits.py", "--steps", "100000", "--checkpoint-dir", str(tmp / "ck"),
            "--checkpoint-every", "1000", "--metrics-log", str(metrics)]
    proc = start("horovodrun-gloo", 2, argv)
    try:
        deadline = time.monotonic() + 120
        while not (metrics.exists() and '"event": "step"' in metrics.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        for i, signum in enumerate(signals):
            os.kill(proc.pid, signum)
            if i + 1 < len(signals):
                time.sleep(gap)
        try:
            out, err = proc.communicate(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"horovodrun still running {STOP_TIMEOUT} s after {signals}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    stops = [r for r in records if r["event"] == "stopped"]
    assert len(stops) == 1, (out, err)
    return proc.returncode, stops[0], out + err


def _no_rank_left(tmp: Path) -> bool:
    """No process whose command line names this run's checkpoint directory is left."""
    mine = str(tmp / "ck").encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if mine in Path(f"/proc/{pid}/cmdline").read_bytes():
                return False
        except OSError:
            continue
    return True


@pytest.mark.slow
@pytest.mark.parametrize(("signals", "status", "said"), [
    ([signal.SIGINT, signal.SIGINT], 130, "SIGINT"),  # (a second Ctrl-C; the mix: make test-long)
    pytest.param([signal.SIGINT, signal.SIGTERM], 130, "SIGINT", marks=pytest.mark.long),
], ids=["INT+INT", "INT+TERM"])
def test_a_second_signal_while_the_first_is_handled_never_hangs(start, tmp_path, signals,
                                                                 status, said):
    for attempt in range(REPEATS):
        tmp = tmp_path / str(attempt)
        tmp.mkdir()
        returncode, stop, out = _stop_once(start, tmp, signals, gap=0.001)
        assert returncode == status, (attempt, out)
        assert stop["signal"] == said, (attempt, stop)
        step = stop["step"]
        assert stop["checkpoint"] == str(tmp / "ck" / f"step_{step:09d}"), stop
        assert (tmp / "ck" / f"step_{step:09d}" / "manifest.json").exists()
        assert f"interrupted: stopped by {said} after step {step}" in out, out
        assert "Traceback" not in out and "RuntimeError" not in out, out
        deadline = time.monotonic() + 10
        while not _no_rank_left(tmp):
            assert time.monotonic() < deadline, f"a rank outlived horovodrun: {out}"
            time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.parametrize(("signum", "status", "word"), [
    (signal.SIGTERM, 75, "preempted"),
    (signal.SIGUSR1, 75, "preempted"),
])
def test_horovodrun_forwards_a_stop_signal_and_exits_with_the_ranks_status(start, tmp_path,
                                                                          signum, status, word):
    """A scheduler's SIGTERM, or the SIGUSR1 a batch script passes on, reaches the ranks as
    that signal: they checkpoint and exit with 75, which horovodrun passes on (a requeueing
    script reads it), without a report of its own."""
    returncode, stop, out = _stop_once(start, tmp_path, [signum], gap=0)
    assert returncode == status, out
    assert stop["signal"] == signum.name, stop
    assert f"{word}: stopped by {signum.name} after step {stop['step']}" in out, out
    assert "Traceback" not in out and "exit with status code" not in out, out
