"""What runs is said before the first step (rank 0), and is the metrics log's first record."""

import json
import socket
import threading

import numpy as np
import pytest

import adapters
import toolkit
from toolkit.datasets import load_digits
from toolkit.trainer.placement import format_placement, gather_nodes, placement_facts
from toolkit.trainer.summary import format_facts, start_facts


@pytest.mark.parametrize(("layout", "world", "local", "words"), [
    (toolkit.DataParallel(), 4, 1, "data parallel over 4 device(s)"),
    (toolkit.Sharded(3, tensor_parallel=2), 4, 1, "sharded:3:tp2 (ZeRO-3) over data=2 x model=2"),
    (toolkit.Sharded(2), 2, 2, "sharded:2 (ZeRO-2) over data=4"),
    (toolkit.Pipeline(2, 4, "gpipe"), 4, 1,
     "pipeline of 2 stages x 2 replica(s), 4 micro-batches, gpipe"),
])
def test_each_layout_says_itself_in_words(layout, world, local, words):
    assert layout.describe(world, local) == words


def test_the_start_is_said_and_logged_with_what_it_resumes(tmp_path, capsys):
    (x, y), _ = load_digits()

    def run(steps, **kw):
        toolkit.Trainer(adapters.get("horovod-torch"), toolkit.MLP((64, 16, 10)),
                        toolkit.SGD(lr=0.1), global_batch_size=64, max_steps=steps,
                        accumulation_steps=2, progress=False, env=toolkit.LaunchEnv(),
                        checkpoint_dir=tmp_path / "ckpt", metrics_log=tmp_path / "log.jsonl",
                        **kw).fit(x, y)
        return capsys.readouterr().out

    with pytest.raises(toolkit.ToolkitError, match="--resume latest: the checkpoint directory "
                       ".*ckpt does not exist\nHINT: check the path .* --resume auto"):
        run(3, resume="latest")  # nothing to resume: a mistyped path never starts over
    assert not (tmp_path / "ckpt").exists()
    out = run(3, resume="auto")  # nothing to resume yet: a new run, said so
    for line in ("backend     horovod-torch, float32",
                 "layout      data parallel over 1 device(s)",
                 "world       1 rank(s) on 1 node(s), 1 per node; devices per rank: cpu",
                 "batch       global 64, local 64 per data share, micro 32",
                 f"model       MLP, {64 * 16 + 16 + 16 * 10 + 10:,} parameters",
                 f"data        {len(x):,} samples, {len(x) // 64} steps per epoch",
                 f"checkpoints {tmp_path / 'ckpt'}: NEW RUN from step 0 (no checkpoint there "
                 "to resume)"):
        assert line in out.splitlines(), (line, out)
    out = run(5, resume="latest")
    assert (f"checkpoints {tmp_path / 'ckpt'}: RESUMED at step 3 from "
            f"{tmp_path / 'ckpt' / 'step_000000003'}") in out.splitlines(), out
    assert f"placement   {socket.gethostname()}: rank 0 (replica 0)" in out.splitlines(), out
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    starts = [r for r in records if r["event"] == "start"]
    assert records[0]["event"] == "start" and len(starts) == 2
    assert starts[0]["placement"] == {"node_count": 1, "nodes": [{
        "index": 0, "node": socket.gethostname(), "ranks": [0], "holds": ["replica 0"],
        "ranks_left_out": 0}]}
    assert starts[0]["parameters"] == 64 * 16 + 16 + 16 * 10 + 10
    assert starts[0]["micro_batch"] == 32 and starts[0]["start_step"] == 0
    assert starts[1]["start_step"] == 3 and starts[1]["resumed_from"].endswith("step_000000003")


@pytest.mark.parametrize(("contents", "found"), [
    ((), "the checkpoint directory {d} is empty"),
    (("notes.txt", "step_000000004.tmp/"),
     "{d} holds no checkpoint (it holds notes.txt, step_000000004.tmp/)"),
])
def test_resume_latest_refuses_a_directory_without_a_checkpoint(tmp_path, capsys, contents,
                                                                 found):
    (x, y), _ = load_digits()
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for name in contents:
        (ckpt / name).mkdir() if name.endswith("/") else (ckpt / name).write_text("mine")

    def run(resume):
        toolkit.Trainer(adapters.get("horovod-torch"), toolkit.MLP((64, 10)),
                        toolkit.SGD(lr=0.1), global_batch_size=64, max_steps=1, progress=False,
                        env=toolkit.LaunchEnv(), checkpoint_dir=ckpt, resume=resume).fit(x, y)

    with pytest.raises(toolkit.ToolkitError) as err:
        run("latest")
    assert str(err.value).splitlines()[0] == "--resume latest: " + found.format(d=ckpt)
    assert sorted(p.name for p in ckpt.iterdir()) == sorted(n.rstrip("/") for n in contents)
    assert (ckpt / "notes.txt").read_text() == "mine" if contents else True  # nothing touched
    run("auto")  # a requeued job's first start: a new run, said so
    assert "NEW RUN from step 0" in capsys.readouterr().out
    run("latest")  # now there is one
    assert f"RESUMED at step 1 from {ckpt / 'step_000000001'}" in capsys.readouterr().out


@pytest.mark.slow
def test_the_block_is_printed_once_per_job(launch):
    job = launch("mpirun", 2, ["examples/train_digits.py", "--steps", "2", "--layout",
                               "sharded:2"], timeout=180)
    assert job.returncode == 0, job
    assert job.stdout.count("backend     horovod-torch, float32") == 1, job
    assert "world       2 rank(s) on 1 node(s), 2 per node; devices per rank: cpu" in job.stdout
    assert "layout      sharded:2 (ZeRO-2) over data=2" in job.stdout
    assert "batch       global 64, local 32 per data share, micro 32" in job.stdout


def test_each_layout_says_its_micro_batch():
    assert toolkit.DataParallel().micro_batch(32, accumulation_steps=4) == 8
    assert toolkit.Sharded(2).micro_batch(32, accumulation_steps=2) == 16
    assert toolkit.Pipeline(2, micro_batches=8).micro_batch(32) == 4


def ranks_on_threads(hosts: list[str]) -> list:
    """``gather_nodes`` on one thread per rank (``hosts[r]``: rank r's host name), whose
    ``allreduce`` sums every rank's array as an adapter's does."""
    n, barrier, given, out = len(hosts), threading.Barrier(len(hosts)), {}, {}

    def rank(r):
        def allreduce(values, op):
            assert op == "sum" and values.dtype == np.float64
            given[r] = values.copy()
            barrier.wait()
            total = sum(given[k] for k in range(n))
            barrier.wait()
            return total
        out[r] = gather_nodes(allreduce, n, r, hosts[r])

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return [out[r] for r in range(n)]


def test_every_rank_learns_which_ranks_share_a_node_and_its_name():
    # Slurm's block placement (2 + 2), a round-robin one, and a node of 3 then 1
    for hosts, nodes in [
        (["node1", "node1", "node2", "node2"], [("node1", [0, 1]), ("node2", [2, 3])]),
        (["a.cluster", "b.cluster", "a.cluster", "b.cluster"],
         [("a.cluster", [0, 2]), ("b.cluster", [1, 3])]),
        (["x", "x", "x", "y"], [("x", [0, 1, 2]), ("y", [3])]),
    ]:
        assert ranks_on_threads(hosts) == [nodes] * len(hosts)
    # 12 nodes: names only for the nodes the table shows (the first three and the last)
    got = ranks_on_threads([f"n{r // 2:02d}" for r in range(24)])[5]
    assert [ranks for _, ranks in got] == [[2 * i, 2 * i + 1] for i in range(12)]
    assert [name for name, _ in got] == ["n00", "n01", "n02", *[None] * 8, "n11"]


def table(nodes, layout, world, local_devices=1):
    return format_placement(placement_facts(nodes, layout, world, local_devices), 12)


def test_the_placement_table_says_what_each_rank_holds_on_each_node():
    two_by_two = [("node1", [0, 1]), ("node2", [2, 3])]
    assert table(two_by_two, toolkit.Pipeline(2, 4), 4) == [
        "node1: rank 0 (replica 0, stage 0)  rank 1 (replica 0, stage 1)",
        "            node2: rank 2 (replica 1, stage 0)  rank 3 (replica 1, stage 1)"]
    assert table(two_by_two, toolkit.Pipeline(2, 4, within_node="replicas"), 4) == [
        "node1: rank 0 (replica 0, stage 0)  rank 1 (replica 1, stage 0)",
        "            node2: rank 2 (replica 0, stage 1)  rank 3 (replica 1, stage 1)"]
    assert table(two_by_two, toolkit.Sharded(3), 4)[1] == (
        "            node2: rank 2 (shard 2)  rank 3 (shard 3)")
    # Slurm's 2 + 1 (tests/test_two_nodes.py prints it from two nodes)
    assert table([("node1", [0, 1]), ("node2", [2])], toolkit.DataParallel(), 3) == [
        "node1: rank 0 (replica 0)  rank 1 (replica 1)", "            node2: rank 2 (replica 2)"]
    # one process per node driving 4 devices (jax-pmap on GPU nodes)
    assert table([("gpu1", [0]), ("gpu2", [1])], toolkit.DataParallel(), 2, 4) == [
        "gpu1: rank 0 (replicas 0-3)", "            gpu2: rank 1 (replicas 4-7)"]


def test_a_large_world_is_abbreviated():
    nodes = [(f"n{i:02d}", [2 * i, 2 * i + 1]) for i in range(16)]
    lines = table(nodes, toolkit.Pipeline(2, 8), 32)
    assert [line.split(":")[0].strip() for line in lines] == [
        "n00", "n01", "n02", "... 12 more node(s) ...", "n15"]
    assert lines[-1] == (
        "            n15: rank 30 (replica 15, stage 0)  rank 31 (replica 15, stage 1)")
    # 64 ranks on a node: the first four, a count, the last three, in columns
    lines = table([("big", list(range(64)))], toolkit.DataParallel(), 64)
    assert lines == [
        "big: rank 0 (replica 0)       rank 1 (replica 1)       rank 2 (replica 2)",
        "                 rank 3 (replica 3)       ... 57 more rank(s) ...  rank 61 (replica 61)",
        "                 rank 62 (replica 62)     rank 63 (replica 63)"]
    assert all(len(line) <= 100 for line in lines)


def test_the_start_up_block_holds_the_table():
    facts = start_facts(
        backend="horovod-torch", layout=toolkit.Pipeline(2, 4), world_size=4, local_size=2,
        num_nodes=2, devices=["cpu"], dtype="float32", global_batch=64, local_batch=32,
        accumulation_steps=1, model=toolkit.MLP((64, 10)), samples=1000, steps_per_epoch=15,
        checkpoint_dir=None, resumed_from=None, resumed_step=0, precision="32",
        placement=placement_facts([("node1", [0, 1]), ("node2", [2, 3])],
                                  toolkit.Pipeline(2, 4), 4))
    lines = format_facts(facts).splitlines()
    at = lines.index("world       4 rank(s) on 2 node(s), 2 per node; devices per rank: cpu")
    assert lines[at + 1:at + 3] == [
        "placement   node1: rank 0 (replica 0, stage 0)  rank 1 (replica 0, stage 1)",
        "            node2: rank 2 (replica 1, stage 0)  rank 3 (replica 1, stage 1)"]
    assert json.loads(json.dumps(facts)) == facts
