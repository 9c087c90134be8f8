"""examples/train_digits.py, unchanged, with every backend under every launcher: real
horovodrun (Gloo and MPI), mpirun and srun.

Data-parallel correctness and cross-framework equivalence ride along: 2 ranks with local batch
32, in any backend, must reproduce one horovod-torch process with batch 64, step for step, to
float32 rounding.
"""

import re

import numpy as np
import pytest

EXAMPLE = "examples/train_digits.py"
STEPS = 50
TOLERANCE = 1e-5  # max relative per-step loss deviation, float32
LAUNCHERS = ("horovodrun-gloo", "horovodrun-mpi", "mpirun", "srun")
BACKENDS = ("horovod-torch", "horovod-tf", "jax-pmap", "jax-pjit")


def example_args(tmp_path, name, backend="horovod-torch"):
    return [EXAMPLE, "--backend", backend, "--steps", str(STEPS), "--batch-size", "64",
            "--seed", "0", "--metrics-log", str(tmp_path / f"{name}.jsonl")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, launch):
    """One process, global batch 64: the sequential run every launcher must reproduce."""
    tmp = tmp_path_factory.mktemp("reference")
    job = launch("python", 1, example_args(tmp, "ref"))
    assert job.returncode == 0, job
    return tmp / "ref.jsonl", job.stdout


def final_accuracy(stdout):
    return re.search(r"done: .* val_accuracy (\d+\.\d+)", stdout).group(1)


def losses(read_metrics, path):
    steps = read_metrics(path)["steps"]
    assert sorted(steps) == list(range(1, STEPS + 1))
    return np.array([steps[k] for k in range(1, STEPS + 1)])


def test_single_process_run_learns(reference, read_metrics):
    path, stdout = reference
    assert "done: world_size 1" in stdout
    assert float(final_accuracy(stdout)) > 0.9
    curve = losses(read_metrics, path)
    assert curve[-5:].mean() < 0.5 * curve[:5].mean()


# make test runs each backend under two launchers and each launcher with two backends; the
# rest of the matrix is long (make test-long).
IN_CI = {("horovod-torch", "horovodrun-gloo"), ("horovod-torch", "mpirun"),
         ("horovod-tf", "horovodrun-mpi"), ("horovod-tf", "mpirun"),
         ("jax-pmap", "horovodrun-gloo"), ("jax-pmap", "srun"),
         ("jax-pjit", "horovodrun-mpi"), ("jax-pjit", "srun")}


@pytest.mark.slow
@pytest.mark.parametrize("backend, launcher", [
    pytest.param(b, launcher, marks=[] if (b, launcher) in IN_CI else [pytest.mark.long])
    for launcher in LAUNCHERS for b in BACKENDS])
def test_two_ranks_reproduce_one_process(backend, launcher, launch, tmp_path, reference,
                                         read_metrics):
    job = launch(launcher, 2, example_args(tmp_path, launcher, backend))
    assert job.returncode == 0, job
    # print0: the summary and every epoch line appear once, not once per rank.
    assert job.stdout.count("done: world_size 2 ") == 1, job
    # (horovodrun prefixes lines with "[0]<stdout>:" or "[1,0]<stdout>:")
    assert len(re.findall(r"^(?:\[[\d,]+\]<stdout>:)?epoch 0 ", job.stdout, re.M)) == 1, job
    ref = losses(read_metrics, reference[0])
    got = losses(read_metrics, tmp_path / f"{launcher}.jsonl")
    deviation = np.max(np.abs(got - ref) / np.abs(ref))
    assert deviation <= TOLERANCE, f"max relative per-step deviation {deviation:.2e}"
    # ...and the same weights: the final validation accuracy matches to the sample.
    assert final_accuracy(job.stdout) == final_accuracy(reference[1])


@pytest.mark.slow
def test_sbatch_template_trains_on_two_tasks(sbatch, tmp_path, read_metrics, reference):
    state, output = sbatch("slurm/train_digits.sbatch", example_args(tmp_path, "sbatch")[1:])
    assert state == "COMPLETED", output
    assert output.count("done: world_size 2 ") == 1, output
    ref = losses(read_metrics, reference[0])
    got = losses(read_metrics, tmp_path / "sbatch.jsonl")
    assert np.max(np.abs(got - ref) / np.abs(ref)) <= TOLERANCE


@pytest.mark.slow
def test_make_example_prints_only_the_toolkits_lines():
    """The README's first command prints the installer's one line and rank 0's training lines,
    nothing from another framework: horovodrun's own build check (patched by the installer)
    loads torch's extension first and silences what a framework prints while it loads, so no
    TensorFlow start-up line reaches the user, with no log-level variable set."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    if Path(sys.prefix).resolve() != (root / ".venv").resolve():  # (make test's environment)
        pytest.skip(f"make example installs into and runs {root / '.venv'}; these tests run "
                    f"in {sys.prefix}, whose packages it must not change")
    job = subprocess.run(["make", "-s", "example"], cwd=root, capture_output=True, text=True,
                         timeout=600)
    assert job.returncode == 0, job
    lines = (job.stdout + job.stderr).splitlines()
    other = [line for line in lines if not (line.startswith("[0]<stdout>:")
                                            or line.startswith("[install] "))]
    assert other == [], other
    assert re.search(r"^\[0\]<stdout>:done: world_size 2 .* val_accuracy 0\.9\d+$",
                     job.stdout, re.M), job.stdout


@pytest.mark.slow
def test_torchrun_serves_the_jax_backends_and_refuses_horovod_clearly(launch):
    job = launch("torchrun", 2, ["examples/train_digits.py", "--backend", "jax-pjit",
                                 "--steps", "3"], timeout=240)
    assert job.returncode == 0, job
    assert "done: world_size 2  steps 3" in job.stdout, job
    job = launch("torchrun", 2, ["examples/train_digits.py", "--backend", "horovod-torch",
                                 "--steps", "3"], timeout=240)
    assert job.returncode != 0, job
    assert "horovod-torch cannot run under torchrun" in job.stderr, job
    assert "launch with horovodrun -np N, mpirun -np N or srun -n N --mpi=pmix" in job.stderr
