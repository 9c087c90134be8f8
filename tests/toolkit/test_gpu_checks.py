"""``tools/gpu_checks.sh`` runs through on a machine without a GPU or Horovod's source, so that
on a GPU machine its time goes to the checks: a stand-in ``nvidia-smi`` names an H100, the
builds fail at once (no source), the GPU tests report themselves skipped, the benchmarks and the
shared-GPU run say why they did not run, and the summary names every phase."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
H100 = """#!/bin/sh
case "$*" in
  -L) echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-2f0c1a7e-5b3d-4c7e-9a41-7d2e0c9b1f00)" ;;
  *query-gpu=compute_cap*) echo "9.0" ;;
  "--query-gpu=name --format=csv,noheader") echo "NVIDIA H100 80GB HBM3" ;;
  *) echo "| NVIDIA-SMI 580.82.07      Driver Version: 580.82.07      CUDA Version: 13.0     |" ;;
esac
"""


def test_the_script_runs_through_and_says_what_ran(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(H100)
    (bin_dir / "nvidia-smi").chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "PYTHON": sys.executable, "HOROVOD_SDIST": str(tmp_path / "missing.tar.gz"),
           "BUDGET": "400"}
    job = subprocess.run(["bash", str(ROOT / "tools" / "gpu_checks.sh"), str(out)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert job.returncode == 0, job.stderr
    summary = (out / "summary.txt").read_text()
    for line in ("machine: NVIDIA H100 80GB HBM3, compute capability 9.0",
                 f"no {tmp_path / 'missing.tar.gz'}: run tools/gpu_checks.sh --prepare",
                 "jax gpu tests: ok",  # (each skipped, with the reason, in jax.log)
                 "horovod with NCCL: build failed or stopped",
                 "jax-pjit GPT-2 small bf16-mixed: exit",  # no GPU here: the Trainer says so
                 "jax-pjit GPT-2 small float32: exit", "jax-pjit update modes: exit",
                 "two ranks on one GPU: not run", "] done"):
        assert line in summary, summary
    assert "needs a GPU: torch sees none here" in (out / "jax.log").read_text()
    assert "device 'gpu' was asked for" in (out / "throughput.log").read_text()
    assert "device 'gpu' was asked for" in (out / "modes.log").read_text()
    assert "GPU 0: NVIDIA H100" in (out / "env.txt").read_text()
    assert "horovod-torch GPT-2 small" not in summary  # no Horovod: not started
