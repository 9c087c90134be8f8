"""Two nodes on this machine (``slurm/local_cluster.sh start --nodes 2``): node1 and node2 are
network namespaces with their own hostnames, addresses, /etc/hosts and node-local directories,
a slurmd each, and a link between them shaped to a fraction of what loopback moves; ssh from
one node to the other is slurm/node_ssh/ssh. What runs across that boundary: Slurm's placement,
the launch environment every rank reads under srun, mpirun and horovodrun, a training run
under each, every backend's layouts against the float64 reference from a batch job of two
nodes, and a checkpoint written from both nodes resumed on one."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

WORKER = "tests/scripts/launch_env_worker.py"
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("launcher, reported", [
    ("srun-2nodes", "srun"), ("mpirun-2nodes", "mpirun"), ("horovodrun-2nodes", "horovodrun"),
    ("horovodrun-mpi-2nodes", "mpirun")])
def test_each_rank_knows_its_node_and_local_rank(launch, two_node_cluster, launcher, reported):
    """srun -N 2 --ntasks-per-node 2, mpirun -hostfile (two slots per node) and horovodrun -H
    node1:2,node2:2 (Gloo, and --mpi: its mpirun) started on node1: ranks 0-1 on node1 and
    2-3 on node2, each with its local rank and node rank, and one coordinator (node1's
    address) for every rank."""
    job = launch(launcher, 4, [WORKER])
    assert job.returncode == 0, job
    rows = sorted(job.results, key=lambda r: r["rank"])
    assert [(r["hostname"], r["rank"], r["local_rank"], r["node_rank"]) for r in rows] == [
        ("node1", 0, 0, 0), ("node1", 1, 1, 0), ("node2", 2, 0, 1), ("node2", 3, 1, 1)], rows
    assert {(r["world_size"], r["local_size"], r["num_nodes"], r["launcher"]) for r in rows} == {
        (4, 2, 2, reported)}
    assert {r["coordinator_ip"] for r in rows} == {"10.77.0.11"}, rows
    assert len({(r["coordinator_address"], r["coordinator_port"]) for r in rows}) == 1, rows


def test_rank_0_says_where_the_ranks_are(launch, two_node_cluster):
    """The start-up block's world line and placement table, from Slurm's placement: two per
    node (a pipeline: each node holds one replica's two stages), or three ranks placed 2 + 1
    (rank 0's node has two)."""
    train = ["examples/train_digits.py", "--steps", "1"]
    job = launch("srun-2nodes", 4, [*train, "--layout", "pipeline:2:4"])
    assert job.returncode == 0, job
    assert "world       4 rank(s) on 2 node(s), 2 per node; devices per rank: cpu" in job.stdout
    lines = job.stdout.splitlines()
    at = lines.index("placement   node1: rank 0 (replica 0, stage 0)  "
                     "rank 1 (replica 0, stage 1)")
    assert lines[at + 1] == ("            node2: rank 2 (replica 1, stage 0)  "
                             "rank 3 (replica 1, stage 1)"), job
    uneven = launch("srun-2nodes", 4, [*train, "--batch-size", "60"], env={"SLURM_NTASKS": "3"})
    assert uneven.returncode == 0, uneven
    assert "3 rank(s) on 2 node(s), 2 on rank 0's node" in uneven.stdout, uneven
    lines = uneven.stdout.splitlines()
    at = lines.index("placement   node1: rank 0 (replica 0)  rank 1 (replica 1)")
    assert lines[at + 1] == "            node2: rank 2 (replica 2)", uneven


@pytest.mark.parametrize("launcher, backend", [
    ("mpirun-2nodes", "horovod-torch"), ("horovodrun-2nodes", "jax-pmap")])
def test_a_training_run_across_the_nodes(launch, two_node_cluster, launcher, backend):
    """mpirun and horovodrun, started on node1, train across both nodes (one step); rank 0's
    placement table names both nodes, whatever the launcher says about them."""
    job = launch(launcher, 4, ["examples/train_digits.py", "--steps", "1", "--backend", backend])
    assert job.returncode == 0, job
    assert "world       4 rank(s) on 2 node(s), 2 per node; devices per rank: cpu" in job.stdout
    assert "placement   node1: rank 0 (replica 0)  rank 1 (replica 1)" in job.stdout, job
    assert "node2: rank 2 (replica 2)  rank 3 (replica 3)" in job.stdout, job
    assert "done: world_size 4  steps 1" in job.stdout, job


def test_the_link_between_nodes_is_slower_than_within_one(two_node_cluster):
    """The shaped link (tc tbf at 1 Gbit/s) against loopback inside a node, each measured by
    sending 64 MiB through a TCP socket."""
    def rate(server: str, client: str, address: str) -> float:
        cmd = ["nsenter", f"--net=/run/netns/toolkit-{server}", "python3", "-c", _RECEIVE,
               address]
        receiver = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        time.sleep(0.5)
        sent = subprocess.run(["nsenter", f"--net=/run/netns/toolkit-{client}", "python3",
                               "-c", _SEND, address], capture_output=True, text=True,
                              timeout=60)
        receiver.wait(timeout=60)
        assert sent.returncode == 0, sent.stderr
        return float(sent.stdout)

    across = rate("node2", "node1", "10.77.0.12")
    within = rate("node1", "node1", "127.0.0.1")
    assert across < 0.2e9 < within / 2, (across, within)


_RECEIVE = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 15801)); s.listen(1); c, _ = s.accept()
while c.recv(1 << 20): pass
"""
_SEND = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], 15801)); buf = b"x" * (1 << 20)
t0 = time.perf_counter()
for _ in range(64): c.sendall(buf)
c.shutdown(socket.SHUT_WR); c.recv(1); print((64 << 20) / (time.perf_counter() - t0))
"""


# (every backend's data parallel across the nodes with make test-long: in make test the scaling
# study and the lost-node test train horovod-torch's across them, and every backend runs
# ZeRO-3 and the pipeline below, whose collectives cross the nodes as data parallel's do)
@pytest.mark.slow
@pytest.mark.parametrize("layouts", [pytest.param("data", marks=pytest.mark.long),
                                     "sharded:3,pipeline:2:4"])
def test_every_backend_equals_the_reference_across_two_nodes(two_node_jobs, tmp_path, layouts):
    """``sbatch --nodes=2 --ntasks=4`` of the equivalence command: inside the allocation its
    runs go through srun, two ranks per node, and data parallel, ZeRO-3 and a pipeline of two
    stages and two replicas equal the float64 reference in every backend."""
    jobs, out = two_node_jobs, tmp_path / "eq.json"
    job = jobs.submit("tests/scripts/equivalence.sbatch", [
        "--world-sizes", "4", "--layout", layouts, "--dtype", "float64",
        "--steps", "3", "--json", str(out)], ntasks=4, nodes=2)
    assert jobs.wait(job, timeout=600) == "COMPLETED", jobs.log()
    rows = json.loads(out.read_text())["results"]
    assert len(rows) == 4 * len(layouts.split(",")), rows
    for r in rows:
        assert (r["launcher"], r["status"]) == ("srun", "pass"), r


def test_a_checkpoint_written_from_two_nodes_resumes_on_one(launch, two_node_cluster, tmp_path):
    """ZeRO-3 on 2 x 2 ranks writes its checkpoint into a directory both nodes see, each rank
    its pieces; one process on this machine resumes it under data parallelism and ends where
    one uninterrupted process does (torch AdamW + OneCycleLR, float64)."""
    worker = ["tests/scripts/native_optimizer_worker.py", "horovod-torch", "20"]
    ckpt = ["--checkpoint-dir", str(tmp_path)]

    def losses(job):
        assert job.returncode == 0, job
        (row,) = job.results
        return row["start"], row["losses"]

    first = losses(launch("srun-2nodes", 4, [*worker, "sharded:3", *ckpt, "--stop-after", "10"]))
    second = losses(launch("python", 1, [*worker, "data", *ckpt, "--resume"]))
    whole = losses(launch("python", 1, [*worker, "data"]))
    assert (first[0], second[0]) == (0, 10)
    assert max(abs(a - b) for a, b in zip(first[1] + second[1], whole[1], strict=True)) < 1e-12


@pytest.mark.slow
def test_the_scaling_study_marks_where_the_job_spans_the_second_node(two_node_jobs, tmp_path):
    """slurm/scaling.sbatch in an allocation of two nodes with one rank per node: N=1 on
    node1, N=2 across the link. The table marks N=2 as spanning another node (the start record
    of its run says 2 nodes), and the picture draws the boundary."""
    from test_scaling import rows

    jobs, png = two_node_jobs, tmp_path / "scaling.png"
    job = jobs.submit("slurm/scaling.sbatch", [
        "--script", "examples/train_digits.py", "--world-sizes", "1,2", "--ranks-per-node", "1",
        "--steps", "20", "--warmup", "5", "--out-dir", str(tmp_path / "runs"), "--png",
        str(png), "--", "--batch-size", "64"], ntasks=2, nodes=2)
    assert jobs.wait(job, timeout=300) == "COMPLETED", jobs.log()
    out = jobs.log()
    table = rows(out)
    assert [(r[1], r[-1]) for r in table.values()] == [("1", "ok"), ("2 *", "ok")], out
    assert "* the job spans another node from this size on" in out
    start = json.loads((tmp_path / "runs" / "world2.jsonl").read_text().splitlines()[0])
    assert (start["world_size"], start["nodes"]) == (2, 2), start

    import matplotlib.image

    image = matplotlib.image.imread(str(png))[..., :3]
    red = (image[..., 0] > 0.7) & (image[..., 1] < 0.3) & (image[..., 2] < 0.3)  # C3's line
    assert red.sum() > 100


# (make test-long: the suite is past 40 minutes; HSDP's runs in make test are on one node)
@pytest.mark.long
@pytest.mark.slow
def test_hsdp_keeps_the_shards_collectives_inside_a_node(two_node_cluster, tmp_path):
    """``sharded:3+replicate:2`` on 2 nodes x 2 ranks, horovod-torch: each node one replica
    (the placement table), and the bytes per step on the link between the nodes, measured on
    the link itself (benchmarks/node_link_bytes.py), are what the ring formula says for its one
    collective across it: 2 P, each shard's all-reduce (ZeRO-3 over the four ranks moves about
    10 P there: docs/layouts/composing.md)."""
    out = tmp_path / "link.json"
    proc = subprocess.run([sys.executable, "benchmarks/node_link_bytes.py", "--backends",
                           "horovod-torch", "--layouts", "sharded:3+replicate:2", "--short", "1",
                           "--long", "3", "--layers", "1", "--width", "64", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    row, = json.loads(out.read_text())["rows"]
    per_p = row["bytes_per_step"] / row["param_bytes"]
    assert 1.9 < per_p < 2.2, (per_p, proc.stdout)
    assert "node1: rank 0 (replica 0, shard 0)  rank 1 (replica 0, shard 1)" in proc.stdout
    assert "node2: rank 2 (replica 1, shard 0)  rank 3 (replica 1, shard 1)" in proc.stdout
