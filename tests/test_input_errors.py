"""A mistake in the user's input (an option, a value, a combination) is said once, by rank 0,
with no traceback, and the shell sees status 2, under every launcher: what the user reads is
what one process prints, plus only the launcher's own report of a failed job."""

from __future__ import annotations

import re

import pytest

EXAMPLE = "examples/train_digits.py"
MISTAKES = {
    "option": ["--stepz", "5"],                    # argparse's usage error
    "value": ["--layout", "shraded:3"],            # a value the toolkit refuses
    "combination": ["--resume", "latest"],         # needs --checkpoint-dir
}
FIRST_LINE = {
    "option": "train_digits.py: error: unrecognized arguments: --stepz 5",
    "value": "error: unknown layout 'shraded:3'",
    "combination": "error: resume='latest' needs a checkpoint directory",
}
QUIET_MPIRUN = {"OMPI_MCA_orte_execute_quiet": "1"}  # mpirun -q: no report of its own
# The launchers' own reports of a job whose rank exited non-zero (not the toolkit's words).
LAUNCHER_LINE = re.compile(r"^(srun: |slurmstepd|-{20,}$|Primary job|a non-zero exit code|"
                           r"mpirun detected|the job to be terminated|\s+Process name:|"
                           r"\s+Exit code:|$)")


def _toolkit_lines(out: str, launcher: str) -> list[str]:
    lines = []
    for line in out.splitlines():
        if launcher.startswith("horovodrun"):
            # horovodrun --gloo tags lines [rank]<stderr>:, --mpi (mpirun) [job,rank]<stderr>:
            m = re.match(r"^\[(?:\d+,)?(\d+)\]<std(?:out|err)>:(.*)$", line)
            if m:
                assert m.group(1) == "0", f"rank {m.group(1)} spoke: {out}"
                line = m.group(2)
        if launcher != "python" and LAUNCHER_LINE.match(line):
            continue
        lines.append(line)
    return lines


@pytest.fixture(scope="module")
def said_by_one_process(launch):
    """What ``python EXAMPLE <mistake>`` prints, per mistake: the reference."""
    said = {}
    for kind, argv in MISTAKES.items():
        job = launch("python", 1, [EXAMPLE, *argv, "--steps", "1"], timeout=120)
        assert job.returncode == 2, job
        said[kind] = (job.stdout + job.stderr).splitlines()
    return said


@pytest.mark.parametrize("kind", list(MISTAKES))
def test_one_process_says_it_once_without_a_traceback(said_by_one_process, kind):
    lines = said_by_one_process[kind]
    assert sum(line == FIRST_LINE[kind] for line in lines) == 1, lines
    assert not any("Traceback" in line or "[rank " in line for line in lines), lines
    if kind == "option":
        assert lines[0].startswith("usage: train_digits.py [-h]") and lines[-1] == FIRST_LINE[kind]
    else:
        assert len(lines) == 2 and lines[1].startswith("HINT: "), lines


@pytest.mark.slow
@pytest.mark.parametrize("launcher,env", [
    # (TensorFlow's start-up lines, which its log level does not hide, would show here if
    # horovodrun's own build check still imported it)
    ("horovodrun-gloo", {"TF_CPP_MIN_LOG_LEVEL": "0"}), ("horovodrun-mpi", QUIET_MPIRUN),
    ("mpirun", QUIET_MPIRUN),
    ("mpirun", {}), ("srun", {}),
], ids=["horovodrun-gloo", "horovodrun-mpi", "mpirun-quiet", "mpirun", "srun"])
def test_every_launcher_says_it_once_by_rank_0_with_status_2(launch, said_by_one_process,
                                                             launcher, env):
    for kind, argv in MISTAKES.items():
        job = launch(launcher, 2, [EXAMPLE, *argv, "--steps", "1"], timeout=120, env=env)
        out = job.stdout + job.stderr
        assert job.returncode == 2, (kind, job)
        assert "Traceback" not in out and "[rank " not in out, (kind, job)
        assert _toolkit_lines(out, launcher) == said_by_one_process[kind], (kind, job)
        if env == QUIET_MPIRUN or launcher == "horovodrun-gloo":  # nothing but the toolkit's
            said = [line for line in out.splitlines() if not re.fullmatch(r"(\[1,0\]<stderr>:)?",
                                                                          line)]
            assert len(said) == len(said_by_one_process[kind]), (kind, job)


@pytest.mark.slow
def test_a_refused_optimizer_is_named_by_class_and_settings(launch):
    """A refused torch optimizer is named as ``NAdam(lr=...)``, not its 14-line repr, once."""
    job = launch("horovodrun-gloo", 2, ["tests/scripts/native_optimizer_worker.py",
                                        "horovod-torch", "2", "sharded:1", "--optimizer",
                                        "NAdam"], timeout=120)
    out = job.stdout + job.stderr
    assert job.returncode == 2, job
    lines = _toolkit_lines(out, "horovodrun-gloo")
    assert len(lines) == 2 and lines[1].startswith("HINT: "), job
    assert re.fullmatch(r"error: under a sharded:1 layout horovod-torch cannot use the "
                        r"optimizer NAdam\(lr=0\.001, .*weight_decay=0\.01.*\): it keeps a "
                        r"per-tensor scalar .*", lines[0]), lines
    assert "Parameter Group" not in out, job
