"""python -m toolkit.scaling for real: the digits example under mpirun at 1, 2 and 3 ranks (3
does not divide the global batch 64: that size fails, is reported, and the study goes on),
with the one-rank reference run that splits the 2-rank step into compute and the rest."""

from __future__ import annotations

import re
import subprocess

import pytest
from conftest import PYTHON, ROOT, child_env


def study(tmp_path, *options: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PYTHON, "-m", "toolkit.scaling", "--script", "examples/train_digits.py",
         "--launcher", "mpirun", "--out-dir", str(tmp_path / "runs"), *options],
        cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)


def rows(out: str) -> dict[int, list[str]]:
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if re.match(r"^N\s+nodes\s+samples/s", line))
    found = {}
    for line in lines[head + 1:]:
        if not re.match(r"^\d+\s", line):
            break
        cells = re.split(r"\s{2,}", line.strip())
        found[int(cells[0])] = cells
    return found


@pytest.mark.slow
def test_strong_scaling_at_1_and_2_ranks_and_a_failing_size(tmp_path):
    png = tmp_path / "scaling.png"
    proc = study(tmp_path, "--world-sizes", "1,2,3", "--mode", "strong", "--steps", "40",
                 "--warmup", "10", "--png", str(png), "--", "--batch-size", "64")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = rows(proc.stdout)
    assert sorted(table) == [1, 2, 3], proc.stdout
    one, two, three = (table[n] for n in (1, 2, 3))
    assert one[-1] == two[-1] == "ok", proc.stdout
    t1, t2 = float(one[2]), float(two[2])
    assert t1 > 0 and t2 > 0
    assert float(one[3]) == 1.0 and float(one[4]) == 1.0
    assert float(two[3]) == pytest.approx(t2 / t1, abs=0.01)  # speed-up
    assert float(two[4]) == pytest.approx(t2 / t1 / 2, abs=0.01)  # efficiency = speed-up / 2
    assert three[1:-1] == ["1"] + ["-"] * 7, proc.stdout
    assert three[-1].startswith("exit ") and "not divisible by the world size 3" in three[-1]
    assert (tmp_path / "runs" / "world2.jsonl").is_file()
    # the step time split: N=1 is its own compute; N=2's compute is one rank at batch 32
    step, compute, comm, wait = (float(two[i]) for i in (5, 6, 7, 8))
    assert float(one[7]) == 0.0 and float(one[6]) == pytest.approx(
        float(one[5]) - float(one[8]), abs=0.15)
    assert compute > 0 and comm == pytest.approx(step - wait - compute, abs=0.15)
    assert "one rank at batch 32 (compute time): ok" in proc.stdout
    reference = (tmp_path / "runs" / "reference32.jsonl").read_text().splitlines()[0]
    assert '"world_size": 1' in reference and '"global_batch": 32' in reference

    import matplotlib.image

    image = matplotlib.image.imread(str(png))[..., :3]
    colored = (image.max(axis=2) - image.min(axis=2)) > 0.3
    width = image.shape[1]
    assert colored[:, : width // 2].sum() > 300 and colored[:, width // 2:].sum() > 300


@pytest.mark.slow
@pytest.mark.long
def test_weak_scaling_grows_the_global_batch(tmp_path, read_metrics):
    proc = study(tmp_path, "--world-sizes", "1,2", "--mode", "weak", "--batch-size", "16",
                 "--steps", "40", "--warmup", "10")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "batch 16 per rank" in proc.stdout
    assert [r[-1] for r in rows(proc.stdout).values()] == ["ok", "ok"], proc.stdout
    starts = [(tmp_path / "runs" / f"world{n}.jsonl").read_text().splitlines()[0]
              for n in (1, 2)]
    assert ['"global_batch": 16' in starts[0], '"global_batch": 32' in starts[1]] == [True,
                                                                                       True]


@pytest.mark.slow
def test_every_size_failing_is_a_failure(tmp_path):
    proc = study(tmp_path, "--world-sizes", "1", "--steps", "2", "--warmup", "0", "--",
                 "--batch-size", "64", "--lr-scaling", "nonsense")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert rows(proc.stdout)[1][-1].startswith("exit 2: "), proc.stdout


@pytest.mark.slow
@pytest.mark.slurm
@pytest.mark.long
def test_the_batch_job_runs_the_study_under_srun(sbatch, tmp_path):
    png = tmp_path / "scaling.png"
    state, output = sbatch("slurm/scaling.sbatch", [
        "--script", "examples/train_digits.py", "--world-sizes", "1,2", "--steps", "40",
        "--warmup", "10", "--png", str(png), "--", "--batch-size", "64"])
    assert state == "COMPLETED", output
    assert "under srun" in output and [r[-1] for r in rows(output).values()] == ["ok", "ok"]
    assert png.stat().st_size > 10_000
