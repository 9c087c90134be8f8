"""Composed layouts (``toolkit.ParallelDims``) in the backends: what each runs, against the
float64 reference and data parallelism, and what each refuses with the dimension named.

The dimension arithmetic itself (placement, data shares, the text form) is tested in
tests/toolkit/test_layouts.py.
"""

import json
import re

import pytest

import adapters
import toolkit
from toolkit.equivalence import LOSS_TOLERANCE


@pytest.mark.parametrize(("backend", "ranks", "placement"), [
    ("jax-pjit", 2, "rank 0 (replica 0, shards 0-1)  rank 1 (replica 1, shards 0-1)"),
    ("jax-pmap", 2, "rank 0 (replica 0, shards 0-1)  rank 1 (replica 1, shards 0-1)"),
    ("horovod-torch", 4, "rank 0 (replica 0, shard 0)  rank 1 (replica 0, shard 1)"),
    ("horovod-tf", 4, "rank 0 (replica 0, shard 0)"),
], ids=["jax-pjit", "jax-pmap", "horovod-torch", "horovod-tf"])
def test_hsdp_equals_the_reference_holds_its_estimate_and_resumes(launch, tmp_path, backend,
                                                                  ranks, placement):
    """``sharded:3+replicate:2`` on 4 devices (tests/scripts/hsdp_worker.py)."""
    job = launch("any", ranks, ["tests/scripts/hsdp_worker.py", backend, str(tmp_path)],
                 timeout=300)
    assert job.returncode == 0, job
    for rank in range(ranks):
        for check in ("sharded:3+replicate:2 equals the reference",
                      "bytes equal the estimate", "the checkpoint resumes as data parallel"):
            assert f"ok {check} on rank {rank}" in job.stdout, (check, job)
    # the start-up block's placement: each replica's ranks (devices) its shards
    assert placement in job.stdout, job
    assert f"rank {ranks - 1} (replica 1, shard" in job.stdout, job


# (horovod-tf's ZeRO-1 and 2 with make test-long: make test runs its ZeRO-3, and every stage
# in horovod-torch)
@pytest.mark.parametrize(("backend", "quick"), [
    ("horovod-torch", False), ("horovod-tf", True),
    pytest.param("horovod-tf", False, marks=[pytest.mark.long, pytest.mark.slow])])
def test_pipeline_x_zero_equals_the_reference_counts_its_collectives_and_resumes(
        launch, tmp_path, backend, quick):
    """``pipeline:2:2+sharded:Z`` on 4 ranks, Z = 1, 2, 3, ZeRO-3 gathered once per step (and
    in horovod-torch per micro-batch) (tests/scripts/pipeline_zero_worker.py): the reference's
    losses and parameters, the gathers and reduce-scatters of the formula, the estimate's
    bytes, its checkpoint resumed as itself (bit for bit) and as data parallel, and a tied
    embedding trained as under data parallelism."""
    job = launch("any", 4, ["tests/scripts/pipeline_zero_worker.py", backend, str(tmp_path),
                            *(["quick"] if quick else [])], timeout=300)
    assert job.returncode == 0, job
    layouts = ["pipeline:2:2+sharded:3"] if quick else [
        "pipeline:2:2+sharded:1", "pipeline:2:2+sharded:2", "pipeline:2:2+sharded:3"]
    if backend == "horovod-torch":
        layouts.append("pipeline:2:2+sharded:3:gather=micro-batch")
    checks = [f"{layout} {what}" for layout in layouts
              for what in ("equals the reference", "collectives", "bytes equal the estimate")]
    checks += ["the checkpoint resumes as pipeline:2:2+sharded:3 bit for bit",
               "the checkpoint resumes as data parallel",
               "a tied embedding trains as under data parallelism"]
    for rank in range(4):
        for check in checks:
            assert re.search(rf"ok {re.escape(check)}\b.*? on rank {rank}(?!\d)", job.stdout), \
                (check, rank, job)


def test_horovod_tf_refuses_to_gather_a_stage_per_micro_batch():
    """TensorFlow's tape keeps what each micro-batch's forward read until its backward: the
    refusal says so, before Horovod starts."""
    adapter = adapters.get("horovod-tf")
    layout = toolkit.parse_layout("pipeline:2:2+sharded:3:gather=micro-batch")
    with pytest.raises(toolkit.ToolkitError) as err:
        adapter.setup(toolkit.LaunchEnv(), layout)
    assert "not per micro-batch (pipeline:2:2:1f1b+sharded:3:gather=micro-batch)" in str(
        err.value) and "tape keeps" in str(err.value) and "HINT" in str(err.value)
    assert adapter.strategy is None


COMPOSED = ("sharded:3+replicate:2", "sharded:1+replicate:2", "data+tensor:2")


# (make test smoke-runs docs/layouts/composing.md's jax-pjit command: data+tensor:2, the GPT)
@pytest.mark.long
@pytest.mark.slow
def test_composed_gpt_layouts_in_jax_pjit_equal_the_reference(launch, tmp_path):
    """The GPT (AdamW, clipped) on 2 processes x 2 devices: HSDP at ZeRO-3 and ZeRO-1, and
    tensor parallelism over plain data parallelism, each within float64's bound of the
    one-process reference, norms before clipping included."""
    out = tmp_path / "eq.json"
    job = launch("python", 1, ["-m", "adapters.equivalence", "--backends", "jax-pjit",
                               "--model", "gpt", "--layout", ",".join(COMPOSED),
                               "--local-devices", "2", "--world-sizes", "2", "--steps", "4",
                               "--dtype", "float64", "--optimizer", "adamw",
                               "--clip-grad-norm", "0.5", "--json", str(out)], timeout=600)
    assert job.returncode == 0, job
    rows = json.loads(out.read_text())["results"]
    assert sorted(r["layout"] for r in rows) == sorted(COMPOSED), rows
    for row in rows:
        assert row["status"] == "pass", row
        assert row["max_rel_loss_dev"] <= LOSS_TOLERANCE["float64"], row


@pytest.mark.parametrize(("backend", "layout", "missing"), [
    ("jax-pmap", "data+tensor:2", "tensor"),
    ("jax-pjit", "pipeline:2:2+sharded:1", "sharded"),
    ("jax-pjit", "pipeline:2:2+tensor:2", "tensor"),
    ("horovod-torch", "pipeline:2:2+sharded:3+replicate:2", "replicate"),
    ("horovod-torch", "data+tensor:2", "tensor"),
])
def test_a_composition_a_backend_does_not_run_is_refused_naming_the_dimension(backend, layout,
                                                                             missing):
    adapter = adapters.get(backend)
    with pytest.raises(toolkit.ToolkitError) as err:
        adapter.setup(toolkit.LaunchEnv(), toolkit.parse_layout(layout))
    assert str(err.value).startswith(
        f"backend {backend!r} does not compose {missing} in {toolkit.parse_layout(layout).name}")
    assert "docs/layouts/composing.md" in str(err.value)
    assert adapter.strategy is None  # refused before any strategy or communicator


def test_a_composition_that_does_not_fit_the_devices_names_the_dimension():
    """``sharded:3+replicate:3`` on this process's 2 devices: the replicas do not fit; the
    hint lists the sizes that would."""
    x = [[0.0] * 5] * 16
    trainer = toolkit.Trainer(adapters.get("jax-pjit"), toolkit.MLP((5, 6, 3)),
                              toolkit.SGD(lr=0.1), global_batch_size=8, max_steps=1,
                              progress=False, layout="sharded:3+replicate:3")
    with pytest.raises(toolkit.ToolkitError) as err:
        trainer.fit(x, [0] * 16)
    assert str(err.value) == (
        "layout sharded:3+replicate:3: replicate 3 does not fit the 2 devices (1 process(es) "
        "x 2)\nHINT: use replicate one of [1, 2], or launch a multiple of 3 devices")


@pytest.mark.parametrize("backend", ["jax-pmap", "jax-pjit"])
def test_a_placement_the_jax_backends_do_not_lay_out_is_refused(backend):
    layout = toolkit.parse_layout("sharded:3+replicate:2+place:replicate:data:tensor:pipeline")
    with pytest.raises(toolkit.ToolkitError) as err:
        adapters.get(backend).setup(toolkit.LaunchEnv(), layout)
    assert str(err.value) == (
        f"{backend} places a sharded layout's devices in the default order only, not "
        "place:replicate:data:tensor:pipeline\nHINT: drop place: (the default: "
        "tensor:data:pipeline:replicate, innermost first)")


# (make test-long: the suite is past 40 minutes; the default placement runs in make test)
@pytest.mark.long
@pytest.mark.slow
def test_another_placement_in_horovod_equals_the_reference(launch, tmp_path):
    """The replicas innermost (ranks 0 and 1 hold the same shard): HSDP's process sets and
    checkpoint writers follow the grid, and the run equals the float64 reference."""
    out = tmp_path / "eq.json"
    layout = "sharded:3+replicate:2+place:replicate:data:tensor:pipeline"
    job = launch("python", 1, ["-m", "adapters.equivalence", "--backends", "horovod-torch",
                               "--world-sizes", "4", "--layout", layout, "--steps", "3",
                               "--dtype", "float64", "--json", str(out)], timeout=300)
    assert job.returncode == 0, job
    row, = json.loads(out.read_text())["results"]
    assert row["layout"] == layout and row["status"] == "pass", row
