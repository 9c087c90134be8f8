"""A command-line mistake is said once per job, with the usage line, and exits non-zero, under
every launcher; every example's --help shows the defaults (once per job)."""

import pytest

EXAMPLES = ["examples/train_digits.py", "examples/train_gpt.py",
            "examples/bring_your_own/torch_cnn.py", "examples/bring_your_own/keras_cnn.py",
            "examples/bring_your_own/flax_cnn.py", "examples/bring_your_own/hf_gpt2.py"]
# What the user's shell sees: the ranks exit 2, and every launcher passes that on.
EXIT = {"python": 2, "mpirun": 2, "srun": 2, "horovodrun-gloo": 2}


@pytest.mark.slow
@pytest.mark.parametrize("launcher", list(EXIT))
def test_a_mistyped_option_is_said_once_with_the_usage_line(launch, launcher):
    nproc = 1 if launcher == "python" else 2
    job = launch(launcher, nproc, ["examples/train_digits.py", "--stepz", "5"], timeout=120)
    out = job.stdout + job.stderr
    assert job.returncode == EXIT[launcher], job
    assert out.count("train_digits.py: error: unrecognized arguments: --stepz 5") == 1, job
    assert out.count("usage: train_digits.py [-h]") == 1, job
    # no rank prints a traceback or the crash line, nor does horovodrun
    assert "Traceback" not in out and "this rank failed" not in out and "[rank " not in out, job


@pytest.mark.parametrize("example", EXAMPLES)
def test_every_example_shows_its_defaults(launch, example):
    job = launch("python", 1, [example, "--help"], timeout=120)
    assert job.returncode == 0, job
    assert job.stdout.count("usage:") == 1
    assert "--batch-size" in job.stdout and "(default: " in job.stdout, job.stdout


@pytest.mark.slow
def test_help_is_printed_once_per_job(launch):
    job = launch("mpirun", 2, ["examples/train_gpt.py", "--help"], timeout=120)
    assert job.returncode == 0, job
    assert job.stdout.count("usage: train_gpt.py") == 1, job
    assert "--steps STEPS" in job.stdout and "(default: 1500)" in job.stdout, job


def _torch_sees_a_gpu() -> bool:
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


@pytest.mark.slow
@pytest.mark.skipif(_torch_sees_a_gpu(), reason="this node has a GPU: --device gpu finds it")
@pytest.mark.parametrize("backend", ["horovod-torch", "horovod-tf", "jax-pmap", "jax-pjit"])
def test_device_gpu_without_a_gpu_is_a_clear_error(launch, backend):
    job = launch("python", 1, ["examples/train_digits.py", "--backend", backend, "--steps", "2",
                               "--device", "gpu"], timeout=120)
    assert job.returncode == 2, job
    assert job.stderr.count("error: device 'gpu' was asked for, but local rank 0 sees no "
                            "GPU") == 1, job
    assert "HINT: run on a node with GPUs" in job.stderr and "Traceback" not in job.stderr
    assert "done:" not in job.stdout
