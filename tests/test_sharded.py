"""Sharded parameters (ZeRO 1-3 / FSDP): every stage equals data parallel, in every backend
that has the ability, at even and odd world sizes; each rank holds its share of the state."""

import json

import pytest

import adapters
import toolkit
from toolkit.equivalence import LOSS_TOLERANCE

SHARDED = [b for b in adapters.BACKENDS
           if isinstance(adapters.get(b), toolkit.ShardedAdapter)]


def equivalence(launch, tmp_path, *args):
    out = tmp_path / "eq.json"
    job = launch("python", 1, ["-m", "toolkit.equivalence", "--json", str(out), *args],
                 timeout=900)
    assert out.exists(), job
    return job, json.loads(out.read_text())["results"]


def test_a_backend_without_the_ability_is_refused_clearly():
    missing = [b for b in adapters.BACKENDS if b not in SHARDED]
    for backend in missing:
        with pytest.raises(toolkit.ToolkitError, match="cannot run layout 'sharded:3'"):
            toolkit.Trainer(adapters.get(backend), toolkit.MLP((4, 2)), toolkit.SGD(lr=0.1),
                            global_batch_size=4, layout="sharded:3")


@pytest.mark.slow
@pytest.mark.parametrize("backend", SHARDED)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_every_stage_equals_the_reference_at_world_sizes_2_and_3(backend, stage, launch,
                                                                   tmp_path):
    job, rows = equivalence(launch, tmp_path, "--backends", backend, "--layout",
                            f"sharded:{stage}", "--world-sizes", "2,3", "--steps", "20",
                            "--batch-size", "48", "--optimizer", "adamw")
    assert job.returncode == 0, job
    for row in rows:
        assert row["status"] == "pass", row
        assert row["max_rel_loss_dev"] <= LOSS_TOLERANCE["float32"], row


@pytest.mark.slow
@pytest.mark.parametrize("backend", SHARDED)
def test_fsdp_gpt_at_an_odd_world_size_and_its_memory(backend, launch, tmp_path):
    """Stage 3 on the GPT over 3 ranks (uneven shards) equals the reference, and each rank
    holds about a third of the replicated state."""
    _, replicated = equivalence(launch, tmp_path, "--backends", backend, "--model", "gpt",
                                "--world-sizes", "3", "--steps", "10", "--batch-size", "48")
    job, rows = equivalence(launch, tmp_path, "--backends", backend, "--model", "gpt",
                            "--layout", "sharded:3", "--world-sizes", "3", "--steps", "10",
                            "--batch-size", "48")
    assert job.returncode == 0, job
    (row,), (whole,) = rows, replicated
    assert row["status"] == "pass", row
    # Persistent state per rank: within 5% of a third of the replicated state (padding to a
    # multiple of 3 is at most 2 elements per unit).
    assert row["state_bytes_per_rank"] <= 1.05 * whole["state_bytes_per_rank"] / 3, (row, whole)
