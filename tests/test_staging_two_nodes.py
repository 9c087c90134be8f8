"""Staging on the two-node cluster (``slurm/local_cluster.sh start --nodes 2``): each node's local
rank 0 copies the data set into that node's own local directory, once, and the other rank of
the node waits for it and reads the same copy.

The nodes' local directories: local_cluster.sh bind-mounts ``$DIR/local/node<i>`` on
``$DIR/nodetmp`` in each node's mount namespace (its slurmd's, which every task inherits), so
one path names a different folder on each node, as ``/local/scratch`` does on a cluster. The
jobs here set ``TMPDIR`` to that path (Slurm passes it on; the test's own ``SLURM_TMPDIR`` is
emptied so that it cannot take precedence) and read the copies from outside through
``$DIR/local/node<i>``. The rest of the file system, the data set's folder included, is shared
by both nodes.
"""

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from toolkit.data.staging import STAGED_FOLDER

WORKER = "tests/scripts/staging_worker.py"
NODES = ("node1", "node2")


@pytest.fixture
def corpus(tmp_path):
    source = tmp_path / "shared" / "corpus.npy"
    source.parent.mkdir()
    source.write_bytes(os.urandom(16 << 20))
    return source


@pytest.fixture
def cluster_dir(two_node_cluster):
    """The cluster's state folder; the staged copies made here are removed afterwards."""
    folder = Path(two_node_cluster["SLURM_CONF"]).parent
    made = []
    yield folder, made
    for path in made:
        shutil.rmtree(path, ignore_errors=True)


def copies(job) -> dict[str, list[str]]:
    """The staging lines of the job's output, by node: ``{node: [copied|re-uses, ...]}``."""
    found = {}
    for line in job.stdout.splitlines():
        if line.startswith("staging: "):
            found.setdefault(line.split()[1], []).append(line.split()[2])
    return found


def test_each_node_stages_its_own_copy_once(launch, cluster_dir, corpus):
    cluster, made = cluster_dir
    nodetmp = cluster / "nodetmp"
    env = {"TMPDIR": str(nodetmp), "SLURM_TMPDIR": ""}
    argv = [WORKER, str(corpus), "--rank0-delay", "1"]
    first = launch("srun-2nodes", 4, argv, env=env)
    assert first.returncode == 0, first
    rows = sorted(first.results, key=lambda r: r["rank"])
    assert [(r["hostname"], r["local_rank"]) for r in rows] == [
        ("node1", 0), ("node1", 1), ("node2", 0), ("node2", 1)], rows
    (path,) = {r["path"] for r in rows}  # one path on every rank...
    relative = Path(path).relative_to(nodetmp)
    assert relative.parts[0] == STAGED_FOLDER and relative.name == "corpus.npy"
    made.extend(cluster / "local" / node / relative.parent for node in NODES)
    digest = hashlib.sha256(corpus.read_bytes()).hexdigest()
    assert {r["sha256"] for r in rows} == {digest}
    assert copies(first) == {"node1": ["copied"], "node2": ["copied"]}, first
    inodes = {}
    for node in NODES:  # ...naming a file of each node's own, made by that node
        copy = cluster / "local" / node / relative
        assert copy.read_bytes() == corpus.read_bytes()
        marker = json.loads(copy.with_name("corpus.npy.staged").read_text())
        assert (marker["host"], marker["sha256"]) == (node, digest)
        inodes[node] = copy.stat().st_ino
        for r in rows:
            if r["hostname"] == node:
                assert r["ino"] == inodes[node], (node, r)
                if r["local_rank"] == 1:  # it asked before its node's copy was made
                    assert r["called"] < marker["finished"] <= r["returned"], (r, marker)
    assert not (nodetmp / relative).exists()  # outside the nodes, that path stays empty

    again = launch("srun-2nodes", 4, argv[:2], env=env)  # a requeued job: nothing copied
    assert again.returncode == 0, again
    assert copies(again) == {"node1": ["re-uses"], "node2": ["re-uses"]}, again
    assert {(r["hostname"], r["ino"]) for r in again.results} == set(inodes.items())


def test_nodes_sharing_one_local_dir_by_mistake_still_read_whole_copies(launch, cluster_dir,
                                                                       corpus, tmp_path):
    """A "local" directory both nodes see (TMPDIR on shared storage): the two local ranks 0
    copy at the same time under temporary names of their own and rename only verified copies,
    so every rank reads the whole file, and no temporary copy is left behind."""
    shared = tmp_path / "not-node-local"
    job = launch("srun-2nodes", 4, [WORKER, str(corpus), "--local-dir", str(shared)])
    assert job.returncode == 0, job
    digest = hashlib.sha256(corpus.read_bytes()).hexdigest()
    assert {r["sha256"] for r in job.results} == {digest} and len(job.results) == 4, job
    (path,) = {r["path"] for r in job.results}
    copy = Path(path)
    assert copy.is_relative_to(shared) and copy.read_bytes() == corpus.read_bytes()
    assert json.loads(copy.with_name("corpus.npy.staged").read_text())["file"]["ino"] == \
        copy.stat().st_ino
    assert sorted(p.name for p in copy.parent.iterdir()) == ["corpus.npy", "corpus.npy.staged"]
    assert sorted(copies(job)) == list(NODES), job  # each node's local rank 0 acted once
    assert all(len(v) == 1 for v in copies(job).values()), job
