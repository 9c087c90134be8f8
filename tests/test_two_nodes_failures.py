"""Failures across the node boundary of the two-node cluster: a node whose processes all die
mid-run, and a cut link between the nodes, each end the job non-zero within a minute with rank
0 naming the lost node; the remaining node resumes from the last checkpoint and ends where an
uninterrupted run of the same world size ends."""

import json
import os
import re
import subprocess
import time

import pytest

import toolkit

EXAMPLE = "examples/train_digits.py"


def _wait_for(what, seconds: float, job=None):
    start = time.monotonic()
    while not what():
        assert job is None or job.poll() is None, job.communicate()
        assert time.monotonic() - start < seconds, f"not within {seconds} s"
        time.sleep(0.2)


def _job_processes(node: str) -> list[int]:
    """The processes of the job on ``node`` (its ranks and their slurmstepd), not its slurmd."""
    pids = subprocess.run(["ip", "netns", "pids", f"toolkit-{node}"], capture_output=True,
                          text=True).stdout.split()
    found = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if EXAMPLE in cmdline or "slurmstepd" in cmdline:
            found.append(int(pid))
    return found


def _named(verdict: str, how: str) -> set[int]:
    """The ranks on node2 the verdict names as ``how`` (a rank's lines are grouped by the step
    it was last heard in: "ranks 2-3 on node2 ...", or "rank 3 ..." and "rank 2 ...")."""
    ranks: set[int] = set()
    for listed in re.findall(rf"ranks? ([\d, -]+) on node2 {how}", verdict):
        for part in listed.split(", "):
            first, _, last = part.partition("-")
            ranks.update(range(int(first), int(last or first) + 1))
    return ranks


def _newest_step(directory) -> int:
    try:
        return toolkit.CheckpointStore(directory).load("latest").step
    except Exception:  # none yet, or one being written
        return -1


@pytest.fixture
def cancel_jobs(two_node_cluster):
    """Cancels what a failed test left queued or running on the two-node cluster."""
    yield
    subprocess.run(["scancel", "-u", "root"], env={**os.environ, **two_node_cluster},
                   capture_output=True)


@pytest.mark.slow
@pytest.mark.usefixtures("cancel_jobs")
def test_a_lost_node_ends_the_job_and_the_other_node_resumes(
        start, launch, read_metrics, two_node_cluster, tmp_path):
    ckpt = tmp_path / "ckpt"
    train = [EXAMPLE, "--dtype", "float64", "--batch-size", "64", "--checkpoint-every", "20",
             "--stall-timeout", "20"]
    job = start("srun-2nodes", 4, [*train, "--steps", "1000000", "--checkpoint-dir",
                                   str(ckpt)], env=two_node_cluster)
    _wait_for(lambda: _newest_step(ckpt) >= 40, 120, job)
    assert _job_processes("node2"), "no rank on node2"
    while _job_processes("node2"):  # (a rank forked meanwhile is killed too)
        subprocess.run(["kill", "-9", *map(str, _job_processes("node2"))], capture_output=True)
    # node1's ranks end by themselves (rank 0 names the lost node); srun then ends too, or,
    # when it waits for the dead node's step, the job is cancelled as a scheduler would
    # cancel it once it declares the node down.
    _wait_for(lambda: not _job_processes("node1"), 60)
    try:
        out, err = job.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        subprocess.run(["scancel", "-u", "root"], env={**os.environ, **two_node_cluster})
        out, err = job.communicate(timeout=60)
    assert job.returncode != 0, (out, err)
    assert _named(err, "ended \\(connection closed\\) in step \\d+") == {2, 3}, err

    last = _newest_step(ckpt)
    end = ["--steps", str(last + 20)]
    resumed = launch("srun-node1", 4, [*train, *end, "--checkpoint-dir", str(ckpt), "--resume",
                                       "latest", "--metrics-log", str(tmp_path / "resumed")])
    assert resumed.returncode == 0, resumed
    whole = launch("srun-2nodes", 4, [*train, *end, "--metrics-log", str(tmp_path / "whole")])
    assert whole.returncode == 0, whole
    after = read_metrics(tmp_path / "resumed")["steps"]
    assert sorted(after) == list(range(last + 1, last + 21)), sorted(after)
    expected = read_metrics(tmp_path / "whole")["steps"]
    assert {s: after[s] for s in after} == {s: expected[s] for s in after}


@pytest.mark.slow
@pytest.mark.usefixtures("cancel_jobs")
def test_a_cut_link_ends_the_job_on_both_nodes(start, read_metrics, two_node_cluster, tmp_path):
    log = tmp_path / "metrics.jsonl"
    job = start("srun-2nodes", 4, [EXAMPLE, "--steps", "1000000", "--stall-timeout", "15",
                                   "--metrics-log", str(log)], env=two_node_cluster)
    _wait_for(lambda: log.exists() and len(read_metrics(log)["steps"]) > 20, 120, job)
    subprocess.run(["ip", "link", "set", "tkv2", "down"], check=True)
    cut = time.monotonic()
    try:  # the ranks of both nodes end by themselves, the link still down
        _wait_for(lambda: not _job_processes("node1") and not any(
            EXAMPLE in open(f"/proc/{p}/cmdline").read() for p in _job_processes("node2")), 60)
        ended = time.monotonic() - cut
    finally:
        subprocess.run(["ip", "link", "set", "tkv2", "up"], check=True)
    out, err = job.communicate(timeout=120)
    assert job.returncode != 0, (out, err)
    assert 15 <= ended < 60, ended
    assert _named(err, "sent nothing for \\d+ s") == {2, 3}, err
    (record,) = [r for r in map(json.loads, log.read_text().splitlines())
                 if r["event"] == "stalled"]
    assert {k: v["host"] for k, v in record["ranks"].items()} == {
        "0": "node1", "1": "node1", "2": "node2", "3": "node2"}, record
