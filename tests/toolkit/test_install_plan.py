"""The installer's choice of builds (``tools/install.sh --plan``: it prints what it would install
and build, and changes nothing). On a machine whose NVIDIA driver lists a GPU, the CUDA builds
and Horovod with NCCL; elsewhere the CPU builds. This machine has no GPU: the GPU node is
stood in for by an ``nvidia-smi`` that prints what the real one prints on a one-H100 node
(its ``-L`` line, its header with the driver's CUDA version, the compute capability); the
real one runs on a GPU node (docs/gpu.md)."""

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

H100 = """#!/bin/sh
case "$*" in
  -L) echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-2f0c1a7e-5b3d-4c7e-9a41-7d2e0c9b1f00)" ;;
  *query-gpu=compute_cap*) echo "9.0" ;;
  *) echo "| NVIDIA-SMI 580.82.07      Driver Version: 580.82.07      CUDA Version: 13.0     |" ;;
esac
"""


def plan(tmp_path, *options, gpu=False):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if gpu:
        (bin_dir / "nvidia-smi").write_text(H100)
        (bin_dir / "nvidia-smi").chmod(0o755)
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                           if not (Path(p) / "nvidia-smi").exists())
    return subprocess.run(["bash", str(ROOT / "tools" / "install.sh"), "--plan", *options],
                          env={**os.environ, "PATH": f"{bin_dir}{os.pathsep}{path}",
                               "TOOLKIT_VENV": str(tmp_path / "never-made")},
                          capture_output=True, text=True, timeout=60)


def test_without_a_gpu_the_cpu_builds(tmp_path):
    job = plan(tmp_path)
    assert job.returncode == 0, job.stderr
    assert "[install] device: cpu (no NVIDIA GPU found)" in job.stderr
    assert "packages: torch tensorflow-cpu jax jaxlib" in job.stderr
    assert "HOROVOD_CPU_OPERATIONS=GLOO" in job.stderr and "-cu" not in job.stderr
    assert not (tmp_path / "never-made").exists()


def test_a_gpu_node_gets_the_cuda_builds_and_horovod_with_nccl(tmp_path):
    job = plan(tmp_path, gpu=True)
    assert job.returncode == 0, job.stderr
    assert "device: gpu: 1 GPU(s), driver CUDA 13.0, compute capability 9.0" in job.stderr
    assert "packages: torch tensorflow[and-cuda] jax[cuda13] jaxlib" in job.stderr
    assert "HOROVOD_GPU_OPERATIONS=NCCL for compute capability 9.0" in job.stderr
    # the wheel cache is keyed by the CUDA major too: a CPU build is never taken for it
    assert "-tf2.21.0-cu13\n" in job.stderr
    assert not (tmp_path / "never-made").exists()


def test_cpu_forces_the_cpu_builds_on_a_gpu_node(tmp_path):
    job = plan(tmp_path, "--cpu", gpu=True)
    assert job.returncode == 0, job.stderr
    assert "device: cpu (1 GPU(s) listed; the CPU builds were asked for)" in job.stderr
    assert "tensorflow-cpu" in job.stderr and "NCCL" not in job.stderr


def test_gpu_without_a_gpu_is_a_clear_error(tmp_path):
    job = plan(tmp_path, "--gpu")
    assert job.returncode == 1
    assert job.stderr.strip().splitlines() == [
        "[install] ERROR: --gpu, but nvidia-smi lists no GPU with a CUDA driver.",
        "HINT: run this on a GPU node (e.g. inside 'srun --gres=gpu:1 ...'), or install the "
        "CPU builds with --cpu."]


@pytest.mark.parametrize("option", ["--gpus", "gpu"])
def test_an_unknown_option_names_the_valid_ones(tmp_path, option):
    job = plan(tmp_path, option)
    assert job.returncode == 2
    assert f"install.sh: unknown option '{option}' (valid: --slurm, --gpu, --cpu, --plan)" \
        in job.stderr
