"""The divergence guard in real jobs: a NaN sample at step K stops every rank at step K with
exit status 3, names the step and the last good checkpoint, writes nothing from the bad state,
and that checkpoint resumes bit for bit. Every backend x layout, two ranks under mpirun.

The runs: tests/scripts/resumable.py, a 3-layer digits MLP, Adam, global batch 48,
checkpoints every 2 steps, a NaN in one sample of step 5's global batch.

TensorFlow on CPU fuses MatMul + BiasAdd + ReLU into one oneDNN kernel inside a tf.function, and
that kernel turns a NaN into 0: a NaN *input* never reaches horovod-tf's loss there
(``TF_ENABLE_ONEDNN_OPTS=0`` keeps it), though it does reach the gradient, whose norm (computed
when clipping) stops the run at the same step. So that every backend stops on the loss here,
the horovod-tf jobs run without oneDNN's fusions; the test after them runs with them.
"""

import json

import numpy as np
import pytest

import toolkit
from toolkit import read_checkpoint

SCRIPT = "tests/scripts/resumable.py"
NAN_AT, EVERY, STEPS = 5, 2, 8
COMMON = ["--mlp", "64,32,32,10", "--batch-size", "48", "--checkpoint-every", str(EVERY)]
LAYOUTS = ["data", "sharded:2", "pipeline:2:4:1f1b"]
BACKENDS = ["horovod-torch", "horovod-tf", "jax-pmap", "jax-pjit"]


def run(launch, tmp, name, backend, layout, extra=(), ckpt="ckpt"):
    args = [SCRIPT, "--backend", backend, "--layout", layout, "--steps", str(STEPS),
            "--checkpoint-dir", str(tmp / ckpt), "--save-model", str(tmp / f"{name}.npz"),
            "--metrics-log", str(tmp / f"{name}.jsonl"), *COMMON, *extra]
    env = {"TF_ENABLE_ONEDNN_OPTS": "0"} if backend == "horovod-tf" else None
    return launch("any", 2, args, timeout=300, env=env)


def stopped_at_the_nan(job, tmp) -> None:
    """Every rank stopped at step NAN_AT, said so once, and saved nothing after step 4."""
    assert job.returncode == toolkit.DIVERGED_EXIT_CODE == 3, job
    good = tmp / "ckpt" / f"step_{NAN_AT - 1:09d}"
    assert job.stderr.count(f"training diverged at step {NAN_AT}: the loss nan is not "
                            f"finite") == 1, job
    assert f"the last good checkpoint is {good}" in job.stderr, job
    assert "Traceback" not in job.stderr, job
    store = toolkit.CheckpointStore(tmp / "ckpt")
    assert [p.name for p in store.checkpoints()] == [f"step_{s:09d}" for s in (2, 4)]
    assert store.load("latest").step == NAN_AT - 1
    assert not (tmp / "bad.npz").exists()  # fit never returned


# make test: every backend's data parallel and pipeline (each backend's own executor hands the
# Trainer its loss) and horovod-torch's ZeRO-2; make test-long: the other backends' ZeRO-2,
# whose loss is their data parallel's
@pytest.mark.slow
@pytest.mark.parametrize("backend, layout", [
    pytest.param(b, layout, marks=[pytest.mark.long] if layout == "sharded:2"
                 and b != "horovod-torch" else []) for b in BACKENDS for layout in LAYOUTS])
def test_a_nan_at_step_k_stops_every_rank_there_with_nothing_saved_after(
        backend, layout, launch, tmp_path, read_metrics):
    job = run(launch, tmp_path, "bad", backend, layout, ["--nan-at", str(NAN_AT)])
    stopped_at_the_nan(job, tmp_path)
    steps = read_metrics(tmp_path / "bad.jsonl")["steps"]
    assert all(np.isfinite(steps[s]) for s in range(1, NAN_AT)) and np.isnan(steps[NAN_AT])


@pytest.mark.slow
@pytest.mark.parametrize("backend, layout", [
    *[(b, "data") for b in BACKENDS], ("horovod-tf", "sharded:2"), ("jax-pmap", "sharded:3"),
    ("jax-pjit", "pipeline:2:4:1f1b")])
def test_a_finite_loss_with_an_overflowing_gradient_stops_at_its_step(backend, layout, launch,
                                                                      tmp_path):
    """A sample of 1e30 keeps the loss finite (about 1e27) but squares past float32's range
    in the gradient's norm, which every backend computes when it clips (here at a bound no
    step reaches)."""
    job = run(launch, tmp_path, "bad", backend, layout, ["--nan-at", str(NAN_AT),
                                                         "--poison", "1e30",
                                                         "--clip-grad-norm", "1e9"])
    assert job.returncode == 3, job
    assert job.stderr.count(f"training diverged at step {NAN_AT}: the loss ") == 1, job
    assert "is finite but the gradient norm inf is not" in job.stderr, job
    store = toolkit.CheckpointStore(tmp_path / "ckpt")
    assert store.load("latest").step == NAN_AT - 1


@pytest.mark.slow
@pytest.mark.parametrize("backend, layout", [("horovod-torch", "data"),
                                             ("jax-pjit", "pipeline:2:4:1f1b")])
def test_the_last_good_checkpoint_resumes_bit_for_bit(backend, layout, launch, tmp_path):
    stopped_at_the_nan(run(launch, tmp_path, "bad", backend, layout,
                           ["--nan-at", str(NAN_AT)]), tmp_path)
    resumed = run(launch, tmp_path, "resumed", backend, layout, ["--resume", "latest"])
    assert resumed.returncode == 0, resumed
    clean = run(launch, tmp_path, "clean", backend, layout, ckpt="clean-ckpt")
    assert clean.returncode == 0, clean
    with np.load(tmp_path / "resumed.npz") as got, np.load(tmp_path / "clean.npz") as ref:
        assert sorted(got.files) == sorted(ref.files) and len(got.files) > 6
        for k in ref.files:
            assert np.array_equal(got[k], ref[k]), k


@pytest.mark.slow
def test_tensorflow_cpu_fusion_hides_a_nan_input_from_the_loss_not_from_the_norm(launch,
                                                                                 tmp_path):
    """With oneDNN's fusions on, the poisoned step's loss is finite; its gradient norm (computed
    when clipping) is not, and the guard stops there all the same. Should a TensorFlow release
    propagate the NaN to the loss, this fails, and the jobs above can keep oneDNN on."""
    job = launch("python", 1, [SCRIPT, "--backend", "horovod-tf", "--steps", str(STEPS),
                               "--checkpoint-dir", str(tmp_path / "ckpt"), "--save-model",
                               str(tmp_path / "m.npz"), "--metrics-log", str(tmp_path / "m.jsonl"),
                               "--nan-at", str(NAN_AT), "--clip-grad-norm", "1e9", *COMMON],
                 timeout=300, env={"TF_ENABLE_ONEDNN_OPTS": "1"})
    assert job.returncode == 3, job
    assert f"training diverged at step {NAN_AT}: the loss " in job.stderr, job
    assert "is finite but the gradient norm nan is not" in job.stderr, job


@pytest.mark.slow
def test_a_loss_far_above_its_best_stops_and_the_newest_checkpoint_predates_the_rise(
        launch, tmp_path, read_metrics):
    """A learning rate of -0.02 climbs the loss (finite): with divergence_factor 4 over 3
    steps the run stops, and a checkpoint scheduled while the loss was above 4x its best was
    held back, so the newest one is from before the rise."""
    job = launch("python", 1, [SCRIPT, "--steps", "40", "--checkpoint-dir",
                               str(tmp_path / "ckpt"), "--save-model", str(tmp_path / "m.npz"),
                               "--metrics-log", str(tmp_path / "m.jsonl"), "--lr", "-0.02",
                               "--divergence-factor", "4", "--divergence-window", "3",
                               *COMMON], timeout=300)
    assert job.returncode == 3, job
    steps = read_metrics(tmp_path / "m.jsonl")["steps"]
    stop = max(steps)
    assert 6 <= stop < 40 and all(np.isfinite(list(steps.values())))
    best = min(steps[s] for s in range(1, stop - 2))
    assert all(steps[s] > 4 * best for s in range(stop - 2, stop + 1)), steps
    assert steps[stop - 3] <= 4 * min(steps[s] for s in range(1, stop - 3)), steps
    assert f"training diverged at step {stop}: the loss" in job.stderr, job
    assert "stayed above 4 x its best" in job.stderr and "for 3 steps" in job.stderr, job
    newest = toolkit.CheckpointStore(tmp_path / "ckpt").checkpoints()[-1]
    # the newest scheduled step not inside the rise (every EVERY steps)
    assert read_checkpoint(newest).step == (stop - 3) // EVERY * EVERY
    assert f"the last good checkpoint is {newest}" in job.stderr, job


@pytest.mark.slow
@pytest.mark.parametrize("launcher, nproc", [("python", 1), ("mpirun", 2)])
def test_the_digits_example_at_lr_1e9_stops_with_the_guards_error(launcher, nproc, launch,
                                                                  tmp_path):
    job = launch(launcher, nproc, ["examples/train_digits.py", "--lr", "1e9", "--epochs", "2",
                                   "--checkpoint-dir", str(tmp_path / "ckpt")], timeout=180)
    assert job.returncode == 3, job
    assert job.stderr.count("error: training diverged at step ") == 1, job
    assert "is not finite; stopped with nothing saved from that state" in job.stderr, job
    assert "HINT: resume from the last good checkpoint with a smaller learning rate" in job.stderr
    assert "done:" not in job.stdout and "Traceback" not in job.stderr, job
    assert not (tmp_path / "ckpt").exists() or not list((tmp_path / "ckpt").glob("step_*"))


# --------------------------------------------------------------------- on_nonfinite="skip"
# make test: every pipeline and a sharded run on two ranks (tests/adapters/test_skipping.py runs
# every backend's data parallel and ZeRO-3 in one process); make test-long: the rest.
SKIP_COVERING = [("horovod-torch", "pipeline:2:4:1f1b"), ("horovod-tf", "sharded:2"),
                 ("horovod-torch", "sharded:2"),
                 ("jax-pmap", "pipeline:2:4:1f1b"), ("jax-pjit", "pipeline:2:4:1f1b")]
SKIP_REST = [pytest.param(b, layout, marks=pytest.mark.long) for b in BACKENDS
             for layout in LAYOUTS if (b, layout) not in SKIP_COVERING]


def same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("backend, layout", [*SKIP_COVERING, *SKIP_REST])
def test_skip_mode_skips_the_nan_step_and_trains_on(backend, layout, launch, tmp_path,
                                                    read_metrics):
    """With --on-nonfinite skip, step K's update is skipped on every rank: the checkpoint
    after it holds the very state of the one before (parameters, optimizer slots and count),
    the metrics log marks it, and the run trains on to the end with finite state."""
    job = run(launch, tmp_path, "skip", backend, layout,
              ["--nan-at", str(NAN_AT), "--on-nonfinite", "skip", "--checkpoint-every", "1",
               "--keep", str(STEPS)])
    assert job.returncode == 0, job
    assert "diverged" not in job.stderr and "Traceback" not in job.stderr, job
    ckpt = tmp_path / "ckpt"
    before, at, after = (read_checkpoint(ckpt / f"step_{s:09d}").tensors
                         for s in (NAN_AT - 1, NAN_AT, NAN_AT + 1))
    assert same_state(before, at), "the skipped step changed the state"
    assert not same_state(at, after), "the step after the skipped one updated nothing"
    if "opt/count" in at:
        assert int(at["opt/count"]) == NAN_AT - 1 and int(after["opt/count"]) == NAN_AT
    final = read_checkpoint(ckpt / f"step_{STEPS:09d}").tensors
    assert all(np.isfinite(v).all() for v in final.values() if v.dtype.kind == "f")
    records = [r for r in map(json.loads, (tmp_path / "skip.jsonl").read_text().splitlines())
               if r["event"] == "step"]
    assert [r["step"] for r in records if r.get("skipped")] == [NAN_AT], records
    assert all(np.isfinite(r["grad_norm"]) for r in records if r["step"] != NAN_AT)
    steps = read_metrics(tmp_path / "skip.jsonl")["steps"]
    assert sorted(steps) == list(range(1, STEPS + 1))


@pytest.mark.slow
@pytest.mark.parametrize("backend, layout", [("jax-pjit", "data"),
                                             ("horovod-tf", "pipeline:2:4:1f1b")])
def test_more_consecutive_skips_than_allowed_stop_the_run(backend, layout, launch, tmp_path):
    job = run(launch, tmp_path, "skips", backend, layout,
              ["--nan-at", "4,5,6", "--on-nonfinite", "skip", "--max-consecutive-skips", "2"])
    assert job.returncode == 3, job
    assert job.stderr.count("training diverged at step 6: the loss nan is not finite, and 3 "
                            "consecutive steps were skipped (max_consecutive_skips=2)") == 1, job
    assert "Traceback" not in job.stderr, job
    assert toolkit.CheckpointStore(tmp_path / "ckpt").load("latest").step == 4


@pytest.mark.slow
@pytest.mark.parametrize("backend", [  # (make test-long: horovod-tf, whose Horovod runtime is
    # horovod-torch's, and jax-pjit, which never shut down MPI)
    "horovod-torch", *(pytest.param(b, marks=pytest.mark.long) for b in ("horovod-tf",
                                                                         "jax-pjit"))])
def test_a_sweep_that_catches_a_divergence_trains_its_next_trainer(backend, launch):
    """A learning-rate sweep (tests/scripts/sweep_worker.py) catches the first rate's
    TrainingDiverged on every rank and builds the next Trainer in the same processes, which
    trains: the communicator is left up for it (an MPI finalised after a divergence cannot
    start again: the job aborted)."""
    job = launch("any", 2, ["tests/scripts/sweep_worker.py", backend], timeout=300)
    assert job.returncode == 0, job
    assert "MPI_FINALIZE" not in job.stdout + job.stderr, job
    rows = job.results
    assert len(rows) == 2, job
    for row in rows:
        first, second = row["runs"]
        assert first["lr"] == 1e4 and 1 <= first["diverged"] <= 5, row
        assert second["lr"] == 0.05 and len(second["losses"]) == 5 and row["finite"], row
    assert rows[0]["runs"][1]["losses"] == rows[1]["runs"][1]["losses"]  # averaged alike
