"""Bad input and failing ranks: a clear error, a non-zero exit, and never a hang."""

import re
import time

import pytest

import toolkit

EXAMPLE = "examples/train_digits.py"


def test_unknown_backend_lists_the_valid_ones(launch):
    job = launch("python", 1, [EXAMPLE, "--backend", "horovod-mxnet", "--steps", "1"])
    assert job.returncode == 2, job
    assert "unknown backend 'horovod-mxnet'" in job.stderr
    assert "horovod-torch, horovod-tf, jax-pmap, jax-pjit" in job.stderr


def test_mismatched_slurm_environment_is_refused(launch):
    job = launch("python", 1, [EXAMPLE, "--steps", "1"],
                 env={"SLURM_JOB_ID": "99", "SLURM_NTASKS": "2", "SLURM_PROCID": "0"})
    assert job.returncode == 2, job
    assert "SLURM_NTASKS=2" in job.stderr and "srun -n 2" in job.stderr


def test_missing_horovod_support_says_what_to_install(launch, tmp_path):
    # A real missing module: None in sys.modules makes 'import horovod.torch' raise ImportError.
    shim = ("import runpy, sys; sys.modules['horovod.torch'] = None; "
            f"sys.argv = [{EXAMPLE!r}, '--steps', '1']; "
            f"runpy.run_path({EXAMPLE!r}, run_name='__main__')")
    job = launch("python", 1, ["-c", shim])
    assert job.returncode == 2, job
    assert "needs Horovod built with PyTorch support" in job.stderr
    assert "tools/install.sh" in job.stderr


@pytest.mark.slow
def test_batch_not_divisible_by_world_size(launch):
    job = launch("horovodrun-gloo", 2, [EXAMPLE, "--batch-size", "63", "--steps", "2"])
    assert job.returncode != 0, job
    assert "global batch size 63 is not divisible by the world size 2" in job.stderr
    assert "such as 62 or 64" in job.stderr


# How each launcher reports rank 1's end. Not "the first rank to fail": when rank 1 dies, rank 0's
# collective fails too, and horovodrun (which polls its workers from threads) sometimes sees rank
# 0's exit first, so these are lines every launcher prints whatever the order (horovodrun names
# the first process it saw fail, and reports no process it stopped itself).
FAILED_RANK_1 = {
    ("horovodrun-gloo", "raise"): "was the first to exit with a non-zero status",
    ("horovodrun-gloo", "kill"): "was the first to exit with a non-zero status",
    ("mpirun", "raise"): "[rank 1/2]", ("mpirun", "kill"): "process rank 1 ",
    ("srun", "raise"): "task 1: Exited with exit code 1", ("srun", "kill"): "task 1: Killed",
}


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["horovodrun-gloo", "mpirun", "srun"])
@pytest.mark.parametrize("mode", ["raise", "kill"])
def test_a_failing_rank_ends_the_whole_job(launch, launcher, mode, tmp_path):
    job = launch(launcher, 2, ["tests/scripts/crash_rank.py"], timeout=90,
                 env={"CRASH_RANK": "1", "CRASH_STEP": "5", "CRASH_MODE": mode,
                      "CHECKPOINT_DIR": str(tmp_path / "ckpt")})
    assert job.returncode != 0, job
    assert job.seconds < 60, job
    assert FAILED_RANK_1[launcher, mode] in job.stdout + job.stderr, job
    if mode == "raise":
        assert "[rank 1/2]" in job.stderr and "injected failure on rank 1" in job.stderr, job
    # The last good checkpoint (step 4, before rank 1's fifth step) is intact.
    assert toolkit.CheckpointStore(tmp_path / "ckpt").load("latest").step == 4


@pytest.mark.slow
@pytest.mark.parametrize("launcher, backend", [
    ("horovodrun-gloo", "horovod-torch"), ("mpirun", "horovod-torch"), ("srun", "horovod-torch"),
    ("horovodrun-gloo", "horovod-tf")])
def test_a_rank_killed_mid_pipeline_schedule_ends_the_job(launch, launcher, backend):
    """Under Pipeline(2, 4), rank 1 SIGKILLs itself at its second step's backward of
    micro-batch 1, while rank 0 waits for a round's alltoall (horovod-tf: on its rounds
    thread)."""
    job = launch(launcher, 2, ["tests/scripts/pipeline_torch_worker.py", "crash", backend],
                 timeout=120, env={"CRASH_RANK": "1"})
    ended = time.time()
    killed = re.search(r"killing rank 1 at B1 at time ([0-9.]+)", job.stdout)
    assert killed, job
    assert job.returncode != 0, job
    assert ended - float(killed.group(1)) < 60, job  # the rest of the job ends, no hang
    assert FAILED_RANK_1[launcher, "kill"] in job.stdout + job.stderr, job
