"""Pipeline checkpoints: every rank writes its stage's tensors (nothing gathered onto rank 0),
under the full model's neutral names. Killed and resumed at the same layout, training continues
bit for bit; a pipeline checkpoint resumes onto data parallel, sharded parameters, another
number of stages and another backend within the equivalence bounds, and onto the other
placement of the ranks (``within_node``), whose table rank 0 prints.

The runs: tests/scripts/resumable.py, a 3-layer digits MLP (so 3 stages are possible), Adam,
global batch 48, killed after the checkpoint of step 20 of 40 (tests/test_sharded.py's helpers).
"""

import json
import socket

import numpy as np
import pytest
from test_sharded import (
    TOLERANCE,
    kill_then_resume,
    losses_after_kill,
    saved_params,
    train,
)

import toolkit

MLP = ["--mlp", "64,32,32,10"]
SOURCE = (2, "horovod-torch", "pipeline:2:4:1f1b")


@pytest.fixture(scope="module")
def uninterrupted(launch, tmp_path_factory):
    """The folder of one uninterrupted run of SOURCE."""
    tmp = tmp_path_factory.mktemp("pipeline-uninterrupted")
    job = train(launch, tmp, "ref", *SOURCE, extra=MLP)
    assert job.returncode == 0, job
    return tmp


@pytest.mark.slow
def test_pipeline_kill_and_resume_is_bit_for_bit(launch, tmp_path, uninterrupted, read_metrics):
    kill_then_resume(launch, tmp_path, SOURCE, SOURCE, extra=MLP)
    ref, got = saved_params(uninterrupted / "ref.npz"), saved_params(tmp_path / "resumed.npz")
    assert ref.keys() == got.keys() and len(ref) == 6
    # The final checkpoint, assembled from the stages' pieces, is the full model.
    final = toolkit.CheckpointStore(tmp_path / "ckpt").load("latest")
    assert final.step == 40 and final.meta["shard_ranks"] == 2
    for k in got:
        assert np.array_equal(final.tensors[k], got[k]), k
    for k in ref:
        assert np.array_equal(ref[k], got[k]), k
    assert np.array_equal(losses_after_kill(read_metrics, tmp_path / "resumed.jsonl"),
                          losses_after_kill(read_metrics, uninterrupted / "ref.jsonl"))


@pytest.mark.slow
@pytest.mark.parametrize("target", [
    (2, "horovod-torch", "data"),
    pytest.param((2, "horovod-torch", "sharded:3"), marks=pytest.mark.long),
    pytest.param((3, "horovod-torch", "pipeline:3:4:gpipe"), marks=pytest.mark.long),
    pytest.param((2, "jax-pjit", "pipeline:2:2:gpipe"), marks=pytest.mark.long),
    pytest.param((2, "horovod-tf", "sharded:2"), marks=pytest.mark.long),
], ids=lambda t: f"{t[1]}-{t[2]}x{t[0]}")
def test_pipeline_checkpoint_resumes_elsewhere(target, launch, tmp_path, uninterrupted,
                                              read_metrics):
    out = kill_then_resume(launch, tmp_path, SOURCE, target, extra=MLP)
    assert f"written by {SOURCE[1]} on {SOURCE[0]} ranks" in out.stdout, out
    ref = losses_after_kill(read_metrics, uninterrupted / "ref.jsonl")
    got = losses_after_kill(read_metrics, tmp_path / "resumed.jsonl")
    assert np.max(np.abs(got - ref) / np.abs(ref)) <= TOLERANCE
    ref_p, got_p = saved_params(uninterrupted / "ref.npz"), saved_params(tmp_path / "resumed.npz")
    assert ref_p.keys() == got_p.keys()
    assert max(np.max(np.abs(ref_p[k] - got_p[k])) for k in ref_p) <= TOLERANCE


@pytest.mark.slow
def test_a_checkpoint_moves_between_the_two_placements_of_the_ranks(launch, tmp_path,
                                                                    uninterrupted, read_metrics):
    """S = 2, D = 2 on 4 ranks under mpirun: written with a replica's stages on neighbouring
    ranks (the default), resumed with a stage's replicas there instead; each run's start-up
    block says where each stage and replica sits."""
    host = socket.gethostname()
    source = (4, "horovod-torch", "pipeline:2:4:1f1b")
    target = (4, "horovod-torch", "pipeline:2:4:1f1b:within-node=replicas")
    out = kill_then_resume(launch, tmp_path, source, target, extra=MLP)
    lines = out.stdout.splitlines()
    at = lines.index(f"placement   {host}: rank 0 (replica 0, stage 0)  "
                     "rank 1 (replica 1, stage 0)")
    assert lines[at + 1].strip() == "rank 2 (replica 0, stage 1)  rank 3 (replica 1, stage 1)"
    # the metrics log's start record holds the same table: the default placement before
    start = json.loads((tmp_path / "killed.jsonl").read_text().splitlines()[0])
    assert start["event"] == "start" and start["placement"]["nodes"] == [{
        "index": 0, "node": host, "ranks": [0, 1, 2, 3], "ranks_left_out": 0,
        "holds": ["replica 0, stage 0", "replica 0, stage 1", "replica 1, stage 0",
                  "replica 1, stage 1"]}]
    ref = losses_after_kill(read_metrics, uninterrupted / "ref.jsonl")
    got = losses_after_kill(read_metrics, tmp_path / "resumed.jsonl")
    assert np.max(np.abs(got - ref) / np.abs(ref)) <= TOLERANCE
    ref_p, got_p = saved_params(uninterrupted / "ref.npz"), saved_params(tmp_path / "resumed.npz")
    assert max(np.max(np.abs(ref_p[k] - got_p[k])) for k in ref_p) <= TOLERANCE
