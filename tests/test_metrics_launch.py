"""The metrics log and TensorBoard's event files of a real 2-rank run (mpirun,
examples/train_digits.py): rank 0 writes them, in the documented schema, and a log file
holds no control characters."""

import json

import pytest


@pytest.mark.slow
def test_two_ranks_write_the_metrics_log_and_tensorboard_files(launch, tmp_path,
                                                               tensorboard_events):
    log, board = tmp_path / "m.jsonl", tmp_path / "tb"
    job = launch("mpirun", 2, ["examples/train_digits.py", "--backend", "horovod-torch",
                               "--steps", "26", "--log-every", "10", "--metrics-log", str(log),
                               "--tensorboard", str(board), "--peak-flops", "1e12"])
    assert job.returncode == 0, job
    assert "\r" not in job.stdout + job.stderr and "\x1b" not in job.stdout + job.stderr
    lines = [line for line in job.stdout.splitlines() if line.startswith("step 10 ")]
    assert len(lines) == 1 and " samples/s  step " in lines[0] and "  mfu " in lines[0], job
    records = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [r for r in records if r["event"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 27))
    assert len({r["time"] for r in steps}) == 26 and all(r["lr"] == 0.05 for r in steps)
    intervals = [r for r in records if r["event"] == "interval"]
    # log_every 10, the epoch's end at 22 (1,438 samples / 64), the run's end
    assert [(r["step"], r["steps"]) for r in intervals] == [(10, 10), (20, 10), (22, 2),
                                                            (26, 4)]
    for r in intervals:
        assert r["world_size"] == 2 and r["samples_per_s"] > 0 and r["step_time_s"] > 0
        assert r["input_wait_s"] >= 0 and r["lr"] == 0.05 and "tokens_per_s" not in r
        assert r["mfu"] == pytest.approx(3 * 2 * (64 * 128 + 128 * 10) * r["samples_per_s"]
                                         / 2e12, rel=1e-5)
    assert [r["step"] for r in records if r["event"] == "eval"] == [22, 26]  # epoch, final
    (events_file,) = board.iterdir()  # rank 0's only
    events = tensorboard_events(board)
    assert [e.step for e in events.Scalars("loss")] == list(range(1, 27)), events_file
    assert [e.value for e in events.Scalars("samples_per_s")] == pytest.approx(
        [r["samples_per_s"] for r in intervals], rel=1e-6)
    assert [e.step for e in events.Scalars("val_loss")] == [22, 26]
