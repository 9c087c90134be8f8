"""Concurrent Slurm jobs on one node get different coordinator ports for JAX's distributed
runtime, from the real local cluster: the ports Slurm reserves per step (``srun --resv-ports=1``,
with ``MpiParams=ports=12000-12999`` in ``slurm/local_cluster.sh``'s slurm.conf), whatever the
job ids. (Ports derived from job ids are the fallback: tests/toolkit/test_env.py.)"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]

# Each task reports what Slurm reserved, the port the toolkit resolves, and when it ran; the
# sleep keeps the jobs running at the same time.
REPORT = ("import os, time; from toolkit.launch.env import detect_launch_env; "
          "start = time.time(); port = detect_launch_env().coordinator_port; "
          "print(os.environ.get('SLURM_STEP_RESV_PORTS'), port, start, flush=True); "
          "time.sleep(4); print('end', time.time(), flush=True)")


def run_at_once(slurm_cluster, count: int, extra: list[str]) -> list[list[str]]:
    env = {**os.environ, **slurm_cluster, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen(["srun", "-n", "1", *extra, sys.executable, "-c", REPORT],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(count)]
    outputs = [proc.communicate(timeout=120) for proc in procs]
    for proc, (_, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err
    return [out.split() for out, _ in outputs]


def test_concurrent_jobs_take_the_ports_slurm_reserved_for_them(slurm_cluster):
    reports = run_at_once(slurm_cluster, 3, ["--resv-ports=1"])
    starts = [float(r[2]) for r in reports]
    ends = [float(r[4]) for r in reports]
    assert max(starts) < min(ends), "the three jobs did not run at the same time"
    reserved = [r[0] for r in reports]
    ports = [int(r[1]) for r in reports]
    assert all(p != "None" for p in reserved), reserved
    assert ports == [int(p.split("-")[0]) for p in reserved]
    assert len(set(ports)) == 3 and all(12000 <= p <= 12999 for p in ports), ports
