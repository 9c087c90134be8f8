"""Preemption: a stop signal checkpoints and exits 75; on Slurm the job requeues itself and
ends with exactly the parameters of an uninterrupted run."""

import signal
import time

import numpy as np
import pytest

import toolkit

EXAMPLE = "examples/train_digits.py"


def wait_for_checkpoint(directory, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if toolkit.CheckpointStore(directory).checkpoints():
            return
        time.sleep(0.1)
    raise AssertionError(f"no checkpoint appeared in {directory}")


def same_params(a, b):
    with np.load(a) as fa, np.load(b) as fb:
        return sorted(fa.files) == sorted(fb.files) and all(
            np.array_equal(fa[k], fb[k]) for k in fa.files)


@pytest.mark.slow
@pytest.mark.parametrize("signame", ["SIGUSR1", "SIGTERM"])
def test_a_stop_signal_checkpoints_and_exits_75(signame, start, launch, tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = start("python", 1, [EXAMPLE, "--steps", "1000000", "--checkpoint-dir", str(ckpt),
                               "--checkpoint-every", "1000"])
    wait_for_checkpoint(ckpt)
    proc.send_signal(getattr(signal, signame))
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == toolkit.PREEMPTED_EXIT_CODE == 75, stderr
    step = toolkit.CheckpointStore(ckpt).load("latest").step
    assert f"preempted: stopped by {signame} after step {step}" in stderr
    assert step % 1000 != 0 or step > 1000  # the stop checkpoint, not just an interval one
    # The same command with --resume latest continues from there.
    resumed = launch("python", 1, [EXAMPLE, "--steps", str(step + 5), "--checkpoint-dir",
                                   str(ckpt), "--resume", "latest"])
    assert resumed.returncode == 0, resumed
    assert f"resumed from {ckpt / f'step_{step:09d}'}" in resumed.stdout
    assert f"steps {step + 5} " in resumed.stdout


@pytest.mark.slow
@pytest.mark.parametrize("target", [pytest.param("tasks", marks=pytest.mark.long), "batch shell"])
def test_slurm_preemption_requeues_and_matches_an_uninterrupted_run(
        target, slurm_jobs, launch, tmp_path):
    args = ["--steps", "2500", "--checkpoint-every", "100"]
    reference = launch("srun", 2, [EXAMPLE, *args, "--save-model", str(tmp_path / "ref.npz")])
    assert reference.returncode == 0, reference
    ckpt = tmp_path / "ckpt"
    job = slurm_jobs.submit("slurm/train_preemptible.sbatch",
                            [*args, "--save-model", str(tmp_path / "final.npz")],
                            env={"CHECKPOINT_DIR": str(ckpt)})
    wait_for_checkpoint(ckpt)
    # 'tasks': what scancel --signal=USR1 does; 'batch shell': what sbatch --signal=B:USR1 does.
    slurm_jobs.signal(job, "USR1", batch_shell=target == "batch shell")
    slurm_jobs.start_requeued_now(job)
    assert slurm_jobs.wait(job, timeout=400) == "COMPLETED", slurm_jobs.log()
    log = slurm_jobs.log()
    assert "preempted: stopped by SIGUSR1" in log, log
    assert f"requeueing job {job}" in log and "(restart count 1)" in log, log
    assert "resumed from" in log and "training ended with status 0" in log, log
    assert same_params(tmp_path / "ref.npz", tmp_path / "final.npz")


def rank_process(launcher_proc, rank: int, script: str, timeout=60):
    """The process of ``rank`` among a launcher's descendants (its OMPI_COMM_WORLD_RANK)."""
    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in psutil.Process(launcher_proc.pid).children(recursive=True):
            try:
                if script in " ".join(child.cmdline()) and \
                        child.environ().get("OMPI_COMM_WORLD_RANK") == str(rank):
                    return child
            except psutil.NoSuchProcess:
                continue
        time.sleep(0.1)
    raise AssertionError(f"no rank {rank} process of {script}")


@pytest.mark.slow
def test_a_signal_on_one_rank_stops_every_rank_at_the_same_step(start, tmp_path):
    """Only rank 1 receives SIGUSR1 (a node-local signal): both ranks agree to stop, write one
    complete checkpoint at the same step, and rank 0 names the signal another rank got."""
    ckpt = tmp_path / "ckpt"
    proc = start("any", 2, [EXAMPLE, "--steps", "1000000", "--checkpoint-dir", str(ckpt),
                            "--checkpoint-every", "1000", "--layout", "sharded:2"])
    wait_for_checkpoint(ckpt)
    rank_process(proc, 1, EXAMPLE).send_signal(signal.SIGUSR1)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == toolkit.PREEMPTED_EXIT_CODE, stderr
    latest = toolkit.CheckpointStore(ckpt).load("latest")  # every rank's pieces are there
    assert f"preempted: stopped by SIGUSR1 on another rank after step {latest.step}" in stderr
    assert latest.step % 1000 != 0


@pytest.mark.slow
def test_checkpoints_by_time_are_taken_at_the_same_steps_on_every_rank(launch, tmp_path):
    """Rank 0's clock decides for all: with rank 1 lagging, the job still ends, and every
    checkpoint it wrote is complete (each rank's pieces of the same step)."""
    ckpt = tmp_path / "ckpt"
    job = launch("any", 2, ["tests/scripts/timed_checkpoints.py", "--checkpoint-dir",
                            str(ckpt)], timeout=180)
    assert job.returncode == 0, job
    store = toolkit.CheckpointStore(ckpt)
    paths = store.checkpoints()
    steps = [store.load(path).step for path in paths]  # strict: every piece present, intact
    assert len(steps) >= 3 and steps[-1] == 40, steps  # by time, then the final one


def interrupt_and_wait(proc, sig, group=False, timeout=120):
    import os

    os.killpg(proc.pid, sig) if group else proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=timeout)
    return stderr


@pytest.mark.slow
def test_ctrl_c_stops_at_a_step_boundary_checkpoints_and_exits_130(start, tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = start("python", 1, [EXAMPLE, "--steps", "1000000", "--checkpoint-dir", str(ckpt),
                               "--checkpoint-every", "1000"])
    wait_for_checkpoint(ckpt)
    stderr = interrupt_and_wait(proc, signal.SIGINT)
    assert proc.returncode == 130, stderr
    step = toolkit.CheckpointStore(ckpt).load("latest").step
    assert f"interrupted: stopped by SIGINT after step {step}; checkpoint " in stderr, stderr
    assert "Traceback" not in stderr


@pytest.mark.slow
def test_a_signal_mpirun_forwards_stops_the_job_with_status_75(start, tmp_path):
    """mpirun forwards SIGUSR1 to the ranks (and a copy may come twice): one line, a complete
    checkpoint, and status 75 passed through."""
    ckpt = tmp_path / "ckpt"
    proc = start("mpirun", 2, [EXAMPLE, "--steps", "1000000", "--checkpoint-dir", str(ckpt),
                               "--checkpoint-every", "1000"])
    wait_for_checkpoint(ckpt)
    time.sleep(1)
    stderr = interrupt_and_wait(proc, signal.SIGUSR1)
    assert proc.returncode == 75, stderr
    step = toolkit.CheckpointStore(ckpt).load("latest").step
    assert stderr.count(f"preempted: stopped by SIGUSR1 after step {step}; checkpoint") == 1
    assert "Traceback" not in stderr


@pytest.mark.slow
@pytest.mark.parametrize(("launcher", "how", "status"), [
    ("mpirun", "Ctrl-C", 1), ("mpirun", "kill", 1), ("horovodrun-mpi", "Ctrl-C", -2)])
def test_ctrl_c_to_mpirun_stops_the_ranks_at_a_step_with_a_checkpoint(launcher, how, status,
                                                                       start, tmp_path):
    """Open MPI's mpirun answers SIGINT (Ctrl-C: to the terminal's process group) and SIGTERM
    (kill) by sending the ranks SIGTERM (and SIGKILL after a grace time) and reports status 1
    itself, no longer forwarding their output; horovodrun --mpi dies of the SIGINT (the shell
    sees 130) and leaves it to its mpirun. Either way the ranks stop together at a step
    boundary and write a complete checkpoint there (not one of the interval's), and the metrics
    log, which no launcher touches, records the stop."""
    import json

    ckpt, log = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    proc = start(launcher, 2, [EXAMPLE, "--steps", "1000000", "--checkpoint-dir", str(ckpt),
                               "--checkpoint-every", "100000", "--metrics-log", str(log)])
    deadline = time.monotonic() + 120
    while not (log.exists() and log.read_text().count('"event": "step"') > 50):
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
        time.sleep(0.5)
    if how == "Ctrl-C":
        stderr = interrupt_and_wait(proc, signal.SIGINT, group=True)
    else:
        stderr = interrupt_and_wait(proc, signal.SIGTERM)
    assert proc.returncode == status, stderr
    deadline = time.monotonic() + 60  # (horovodrun is gone before its mpirun's ranks are)
    while '"event": "stopped"' not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.5)
    latest = toolkit.CheckpointStore(ckpt).load("latest")
    assert 0 < latest.step < 100000
    records = [json.loads(line) for line in log.read_text().splitlines()]
    stopped = [r for r in records if r["event"] == "stopped"]
    assert len(stopped) == 1 and stopped[0]["signal"] in ("SIGINT", "SIGTERM"), stopped
    assert stopped[0]["step"] == latest.step == max(r["step"] for r in records
                                                     if r["event"] == "step")
    assert stopped[0]["checkpoint"] == str(ckpt / f"step_{latest.step:09d}")


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["horovodrun-gloo"])
def test_ctrl_c_under_horovodrun_checkpoints_without_horovod_noise(launcher, start, tmp_path):
    """Ctrl-C reaches horovodrun's process group; horovodrun passes the SIGINT on to the ranks.
    The ranks stop together and shut Horovod down in order: no broken-connection report, and
    horovodrun exits with their 130, without a report of its own."""
    ckpt = tmp_path / "ckpt"
    proc = start(launcher, 2, [EXAMPLE, "--steps", "1000000", "--checkpoint-dir",
                                        str(ckpt), "--checkpoint-every", "1000"])
    wait_for_checkpoint(ckpt, timeout=180)
    time.sleep(1)
    stderr = interrupt_and_wait(proc, signal.SIGINT, group=True)
    assert proc.returncode == 130, stderr
    step = toolkit.CheckpointStore(ckpt).load("latest").step
    assert stderr.count(f"interrupted: stopped by SIGINT after step {step}; checkpoint ") == 1
    assert "horovodrun:" not in stderr and "RuntimeError" not in stderr, stderr
    assert "Horovod background loop uncaught exception" not in stderr, stderr
    assert "<stderr>:Traceback" not in stderr, stderr


@pytest.mark.slow
@pytest.mark.parametrize(("how", "status", "line"), [
    ("kill -USR1 <srun pid>", 75, "preempted: stopped by SIGUSR1"),
    ("scancel --signal=INT <job>", 130, "interrupted: stopped by SIGINT"),
    ("scancel --signal=TERM <job>", 75, "preempted: stopped by SIGTERM")])
def test_stopping_an_srun_job_checkpoints_and_srun_passes_the_status_on(
        how, status, line, start, slurm_cluster, tmp_path):
    """srun forwards SIGUSR1 to the tasks; scancel --signal sends a signal to them without
    ending the step (srun's own Ctrl-C reports the step's state, and a second one within a
    second ends the step: Slurm kills the tasks after KillWait, as the README says). Each way
    the ranks stop together, one line names the signal, and srun exits with the tasks'
    status."""
    import os
    import subprocess

    ckpt, name = tmp_path / "ckpt", f"stop-test-{tmp_path.name}"
    proc = start("srun", 2, [EXAMPLE, "--steps", "1000000", "--checkpoint-dir", str(ckpt),
                             "--checkpoint-every", "1000"],
                 env={**slurm_cluster, "SLURM_JOB_NAME": name})
    wait_for_checkpoint(ckpt, timeout=180)
    time.sleep(1)
    if how.startswith("kill"):
        stderr = interrupt_and_wait(proc, signal.SIGUSR1)
    else:
        env = {**os.environ, **slurm_cluster}
        job = subprocess.run(["squeue", "-h", "--name", name, "-o", "%i"], env=env,
                             capture_output=True, text=True, check=True).stdout.split()
        assert len(job) == 1, job
        signame = how.split("=")[1].split()[0]
        subprocess.run(["scancel", f"--signal={signame}", job[0]], env=env, check=True)
        _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == status, stderr
    step = toolkit.CheckpointStore(ckpt).load("latest").step
    assert stderr.count(f"{line} after step {step}; checkpoint") == 1, stderr
    assert "Traceback" not in stderr, stderr
