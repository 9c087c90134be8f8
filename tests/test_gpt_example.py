"""examples/train_gpt.py under every launcher: a tiny GPT on the standard library's bytes, the
same losses on 2 ranks as on 1 process, the lines a user reads, and a resume."""

import json
import re
import shutil

import numpy as np
import pytest

import toolkit
from toolkit import read_checkpoint

GPT = "examples/train_gpt.py"
TINY = ["--layers", "2", "--width", "32", "--heads", "2", "--context", "32", "--steps", "20",
        "--eval-every", "10", "--batch-size", "8", "--eval-windows", "16", "--sample-bytes", "20"]


def args(tmp_path, name, backend="horovod-torch", extra=()):
    return [GPT, "--backend", backend, *TINY, "--metrics-log", str(tmp_path / f"{name}.jsonl"),
            *extra]


def losses(read_metrics, path):
    steps = read_metrics(path)["steps"]
    return np.array([steps[k] for k in range(1, 21)])


@pytest.fixture(scope="module")
def one_process(launch, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpt-one")
    job = launch("python", 1, args(tmp, "one"))
    assert job.returncode == 0, job
    return job, tmp / "one.jsonl"


def test_the_example_prints_what_a_user_needs(one_process):
    job, _ = one_process
    out = job.stdout
    assert re.search(r"validation unigram entropy \d\.\d+ nats/byte", out), out
    assert len(re.findall(r"^step +\d+  loss \d+\.\d+  val \d+\.\d+ nats/byte \(\d+\.\d+ "
                          r"bits/byte\)  [\d,]+ tokens/s$", out, re.M)) == 2, out
    done = re.search(r"done: world_size 1  steps 20  val_loss (\d+\.\d+) nats/byte = "
                     r"(\d+\.\d+) x the unigram entropy", out)
    assert done and float(done.group(1)) < np.log(256), out
    assert "sample: def __init__(self" in out
    inputs = re.search(r"^input: the prefetch thread spent (\d+\.\d+) s loading batches; the "
                       r"training loop waited (\d+\.\d+) s for them \((\d+\.\d+)% of its (\d+) "
                       r"s; the wait includes each hand-over between the threads\)$", out, re.M)
    assert inputs and float(inputs.group(2)) >= 0, out
    assert 0 <= float(inputs.group(3)) <= 100 and int(inputs.group(4)) >= 0, out
    assert job.stderr.count("tensorflow") == 0, job.stderr  # no other framework's chatter


@pytest.mark.slow
@pytest.mark.parametrize("backend, launcher", [  # every launcher once in make test
    pytest.param(b, launcher, marks=[] if (b, launcher) in {
        ("horovod-torch", "horovodrun-gloo"), ("horovod-torch", "mpirun"),
        ("jax-pjit", "srun")} else [pytest.mark.long])
    for launcher in ("horovodrun-gloo", "mpirun", "srun") for b in ("horovod-torch", "jax-pjit")])
def test_two_ranks_reproduce_one_process(backend, launcher, launch, tmp_path, one_process,
                                         read_metrics):
    # under mpirun, from a node-local copy of the corpus that one of the two ranks makes
    staged = ["--stage-data", str(tmp_path / "local")] if launcher == "mpirun" else []
    job = launch(launcher, 2, args(tmp_path, "two", backend, staged))
    assert job.returncode == 0, job
    assert job.stdout.count("done: world_size 2 ") == 1, job
    assert job.stdout.count("staging: ") == job.stdout.count(" copied ") == len(staged) // 2
    assert "[Gloo]" not in job.stdout, job  # no other library's chatter (jaxlib's Gloo)
    ref, got = losses(read_metrics, one_process[1]), losses(read_metrics, tmp_path / "two.jsonl")
    assert np.max(np.abs(got - ref) / np.abs(ref)) <= 1e-5


@pytest.mark.slow
def test_resume_continues_from_the_checkpoint(launch, tmp_path, read_metrics):
    """A 30-step run whose last checkpoint is then removed, as if it had been killed after
    step 20's: rerun with ``--resume latest``, it takes the last 10 steps of the uninterrupted
    run bit for bit (the same losses, and a step-30 checkpoint equal to the removed one)."""
    ckpt = tmp_path / "ckpt"
    run = ["--steps", "30", "--checkpoint-dir", str(ckpt)]
    first = launch("any", 2, args(tmp_path, "a", extra=run))
    assert first.returncode == 0, first
    saved = {read_checkpoint(p).step: p for p in toolkit.CheckpointStore(ckpt).checkpoints()}
    assert {20, 30} <= saved.keys(), saved  # one at the end of each evaluation interval
    uninterrupted = read_checkpoint(saved[30])
    shutil.rmtree(saved[30])
    again = launch("any", 2, args(tmp_path, "b", extra=[*run, "--resume", "latest"]))
    assert again.returncode == 0, again
    assert f"resumed from {saved[20]} (step 20, written by horovod-torch" in again.stdout, again
    assert "done: world_size 2  steps 30" in again.stdout
    before = read_metrics(tmp_path / "a.jsonl")["steps"]
    after = read_metrics(tmp_path / "b.jsonl")["steps"]
    assert sorted(after) == list(range(21, 31)), after
    assert [after[k] for k in after] == [before[k] for k in after]
    resumed = read_checkpoint(saved[30])  # written again, by the resumed run
    assert resumed.step == 30
    assert resumed.tensors.keys() == uninterrupted.tensors.keys()
    assert "params/blocks.1.attn.qkv.kernel" in resumed.tensors
    for name, value in uninterrupted.tensors.items():
        np.testing.assert_array_equal(resumed.tensors[name], value, err_msg=name)


@pytest.mark.slow
def test_resuming_with_another_schedule_stops_unless_allowed(launch, tmp_path):
    """``--steps`` sets the cosine schedule's length: resuming a 20-step run with
    ``--steps 30`` would change it; the run says so and exits 2, and goes on when allowed."""
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "10"]
    first = launch("python", 1, args(tmp_path, "first", extra=ckpt))
    assert first.returncode == 0, first
    longer = [a if a != "20" else "30" for a in args(tmp_path, "second", extra=ckpt)]
    refused = launch("python", 1, [*longer, "--resume", "latest"])
    assert refused.returncode == 2, refused
    assert "optimizer.lr.total_steps 20 -> 30" in refused.stderr, refused
    assert "optimizer.lr.warmup_steps" not in refused.stderr  # max(1, steps // 20) is 1 both
    allowed = launch("python", 1, [*longer, "--resume", "latest", "--allow-changes"])
    assert allowed.returncode == 0, allowed
    assert "resumed with changed settings (allowed): optimizer.lr.total_steps 20 -> 30" in \
        allowed.stdout, allowed


def eval_records(path) -> list[dict]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in records if r["event"] == "eval"]


def test_every_evaluation_is_in_the_metrics_log(one_process):
    job, log = one_process
    evals = eval_records(log)
    assert [(r["step"], r["val_windows"], r.get("final", False)) for r in evals[:2]] == [
        (10, 16, False), (20, 16, False)], evals
    final = evals[2]
    assert final["final"] and final["step"] == 20 and final["val_windows"] > 40_000
    assert f"val_loss {final['val_loss']:.4f} nats/byte" in job.stdout


def test_the_final_evaluation_takes_its_budget(launch, tmp_path):
    """``--final-eval-windows 256``: the first 256 windows, and the line says so; 0 skips."""
    short = [a if a != "20" else "2" for a in TINY]
    job = launch("python", 1, [GPT, *short, "--final-eval-windows", "256", "--metrics-log",
                               str(tmp_path / "m.jsonl")])
    assert job.returncode == 0, job
    assert re.search(r"^done: world_size 1  steps 2  val_loss \d+\.\d+ nats/byte = .* \(256 of "
                     r"[\d,]+ validation windows\)$", job.stdout, re.M), job.stdout
    assert eval_records(tmp_path / "m.jsonl")[-1]["val_windows"] == 256
    refused = launch("python", 1, [GPT, *short, "--final-eval-windows", "-1"])
    assert refused.returncode == 2 and "--final-eval-windows -1 must be >= 0" in \
        refused.stderr, refused
    refused = launch("python", 1, [GPT, *short, "--eval-every", "0"])
    assert refused.returncode == 2 and "--eval-every 0: the steps between evaluations must " \
        "be at least 1" in refused.stderr, refused


@pytest.mark.long
def test_the_final_evaluation_shows_its_progress(launch):
    """The whole validation split at context 16 (about 98,000 windows) takes several seconds:
    rank 0 prints plain progress lines (no carriage returns in a log), then the result."""
    small = ["--layers", "1", "--width", "32", "--heads", "2", "--context", "16", "--steps",
             "1", "--eval-every", "1", "--batch-size", "4", "--eval-windows", "4",
             "--sample-bytes", "4"]
    job = launch("python", 1, [GPT, *small])
    assert job.returncode == 0, job
    progress = re.findall(r"^final eval ([\d,]+)/([\d,]+) windows, (\d+) s$", job.stdout, re.M)
    assert progress and all(int(d.replace(",", "")) < int(t.replace(",", ""))
                            for d, t, _ in progress), job.stdout
    assert "\r" not in job.stdout and "\x1b" not in job.stdout
