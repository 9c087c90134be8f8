"""Staging under a real launcher: mpirun -np 3 on this node, so three local ranks of one node.

Local rank 0 makes the one copy while the other two wait for it on the file system; every rank
reads the same local file; a second job re-uses it. (Several nodes: test_staging_two_nodes.py.)
"""

import hashlib
import json
import os
from pathlib import Path

import pytest

WORKER = "tests/scripts/staging_worker.py"


@pytest.fixture
def corpus(tmp_path):
    source = tmp_path / "shared" / "corpus.npy"
    source.parent.mkdir()
    source.write_bytes(os.urandom(24 << 20))  # 3 chunks of the copy
    return source


@pytest.mark.slow
def test_one_copy_per_node_and_every_rank_reads_it(launch, corpus, tmp_path):
    local = tmp_path / "local"
    argv = [WORKER, str(corpus), "--local-dir", str(local), "--rank0-delay", "1"]
    first = launch("mpirun", 3, argv)
    assert first.returncode == 0, first
    assert first.stdout.count("staging: ") == first.stdout.count(" copied ") == 1, first
    rows = sorted(first.results, key=lambda r: r["rank"])
    assert [r["local_rank"] for r in rows] == [0, 1, 2], rows
    (path,) = {r["path"] for r in rows}
    assert path.startswith(f"{local}/toolkit-staged/") and path.endswith("/corpus.npy")
    assert len({r["ino"] for r in rows}) == 1  # one file
    digest = hashlib.sha256(corpus.read_bytes()).hexdigest()
    assert {r["sha256"] for r in rows} == {digest}
    marker = json.loads(Path(path).with_name("corpus.npy.staged").read_text())
    assert marker["sha256"] == digest
    # the two that waited asked before local rank 0 had finished, and got the path after it
    for r in rows[1:]:
        assert r["called"] < marker["finished"] <= r["returned"], (r, marker)
    assert sorted(p.name for p in Path(path).parent.iterdir()) == [
        "corpus.npy", "corpus.npy.staged"]  # no temporary copy left

    again = launch("mpirun", 3, argv[:4])  # a re-run of the job: nothing copied
    assert again.returncode == 0, again
    assert again.stdout.count("staging: ") == again.stdout.count(" re-uses ") == 1, again
    assert {(r["path"], r["ino"], r["sha256"]) for r in again.results} == {
        (path, rows[0]["ino"], digest)}
