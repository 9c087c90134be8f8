"""A rank that stops answering (SIGSTOP) or hangs outside the collectives (its data set's
``batch`` never returns) ends the job within the stall timeout, in every backend and under
every launcher, and rank 0 (or, when rank 0 is the one stopped, the others) names the rank,
its node, the step and what the others wait in. Never a silent hang."""

import json
import re

import pytest

WORKER = "tests/scripts/crash_rank.py"
TIMEOUT = 10  # seconds; start-up on a loaded 2-core machine stays below it


@pytest.mark.slow
@pytest.mark.parametrize("launcher, backend, mode, rank", [
    ("mpirun", "horovod-torch", "stop", 1),
    ("horovodrun-gloo", "horovod-tf", "stop", 0),
    # (a stopped rank 1 under mpirun: horovod-torch's in make test)
    pytest.param("mpirun", "jax-pjit", "stop", 1, marks=pytest.mark.long),
    ("srun", "jax-pmap", "hang", 1)])
def test_a_rank_that_does_not_arrive_ends_the_job_with_its_name(
        launch, launcher, backend, mode, rank, tmp_path):
    log = tmp_path / "metrics.jsonl"
    job = launch(launcher, 2, [WORKER], timeout=150, env={
        "BACKEND": backend, "CRASH_MODE": mode, "CRASH_RANK": str(rank), "CRASH_STEP": "40",
        "STALL_TIMEOUT": str(TIMEOUT), "METRICS_LOG": str(log)})
    out = job.stdout + job.stderr
    assert job.returncode != 0, job
    assert job.seconds < TIMEOUT + 60, job
    if rank == 0:  # the others hear nothing from rank 0 and say so themselves
        assert re.search(rf"\[rank 1/2\] stalled: rank 0 answered nothing for {TIMEOUT} s; "
                         r"this rank waits in step \d+ \(the step's collectives\)", out), job
        return
    late = {"stop": r"rank 1 on \S+ sent nothing for \d+ s, last in step \d+",
            "hang": r"rank 1 on \S+ did not arrive: still in step 40 \(loading its batch\)"}
    assert re.search(late[mode], out), job
    # (JAX dispatches steps ahead: its rank 0 waits where it first needs a result)
    assert re.search(r"rank 0 on \S+ waits in step (\d+) \(the step's collectives\)", out), job
    (record,) = [r for r in map(json.loads, log.read_text().splitlines())
                 if r.get("event") == "stalled"]
    assert record["timeout"] == TIMEOUT and record["ranks"]["1"]["step"] <= 40, record
