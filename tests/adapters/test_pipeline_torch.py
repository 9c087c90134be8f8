"""horovod-torch's pipeline stages: equal to the float64 reference under GPipe and 1F1B (one and
two replicas), checkpoints of every rank's pieces read back as the full model, the measured
bubble of a real S = 2, M = 8 run beside the formula, and bad input (a rank killed
mid-schedule, under every launcher: tests/test_failures.py).

The multi-rank checks run tests/scripts/pipeline_torch_worker.py.
"""

import json

import numpy as np
import pytest

import adapters
import toolkit
from adapters.horovod_torch.pipeline import TorchPipeline
from toolkit import MLP, SGD, Pipeline, ToolkitError
from toolkit.datasets import load_digits
from toolkit.parallel.layouts import resolve_layout

WORKER = "tests/scripts/pipeline_torch_worker.py"


def pipelined_adapter():
    return adapters.get("horovod-torch")


def results(job, ranks: int) -> list[dict]:
    assert job.returncode == 0, job
    rows = job.results
    assert len(rows) == ranks, job
    return sorted(rows, key=lambda r: r["rank"])


def check_equivalence(rows: list[dict], schedule: str, ranks: int) -> None:
    """The worker's ``equivalence`` rows (any backend) against the reference's bounds."""
    for row in rows:
        for model in ("mlp", "gpt"):
            r = row[model]
            assert r["loss_dev"] <= 1e-10 and r["param_dev"] <= 1e-10, (model, row)
            # every rank's pieces of the checkpoint concatenate to the full model
            assert r["ckpt_names"] and r["ckpt_dev"] == 0.0, (model, row)
            grid = Pipeline(2, 4).grid(ranks)  # a replica's stages on neighbouring ranks
            assert r["position"] == [grid.stage_of(row["rank"]), grid.replica_of(row["rank"])]
        assert row["mlp"]["eval_dev"] <= 1e-10, row
        # resumed from step 3 of 6: bit for bit at the same layout, equal onto data parallel
        assert row["mlp"]["resume_dev_pipeline"] == 0.0, row
        assert row["mlp"]["resume_dev_data"] <= 1e-12, row
    # each stage holds its own layers only: the MLP's 64x128 layer on stage 0, 128x10 on 1
    # (interleaved 64-32-32-32-10: layers 0 and 2 on stage 0, 1 and 3 on stage 1)
    first, last = ((64 * 32 + 32 + 32 * 32 + 32, 32 * 32 + 32 + 32 * 10 + 10)
                   if schedule == "interleaved-1f1b" else (64 * 128 + 128, 128 * 10 + 10))
    assert rows[0]["mlp"]["bytes"]["params"] == first * 8
    assert rows[-1]["mlp"]["bytes"]["params"] == last * 8


@pytest.mark.slow
@pytest.mark.parametrize(("backend", "stages", "ranks"), [
    ("horovod-torch", 2, 4),  # D = 2: each stage's replicas {0, 2} and {1, 3}
    # the tied tok_emb's end stages {0, 2}; make test runs TF's allreduce hook in the global
    # set (test_pipeline_tf: the tied GPT on 2 ranks)
    pytest.param("horovod-tf", 3, 3, marks=pytest.mark.long),
])
def test_gradients_are_averaged_in_horovod_process_sets(launch, backend, stages, ranks):
    """A tied GPT's pipeline averages each stage's gradients over its replicas, and sums the
    tied embedding's over its two end stages, in Horovod process sets registered at hvd.init,
    equal to the float64 reference; a layout needing a set Horovod was not started with is a
    clear error."""
    job = launch("any", ranks,
                 [WORKER, "process_sets", backend, str(stages)], timeout=300)
    rows = results(job, ranks)
    grid = Pipeline(stages, 4).grid(ranks)
    for row in rows:
        stage, replica = row["position"]
        assert (stage, replica) == (grid.stage_of(row["rank"]), grid.replica_of(row["rank"]))
        assert row["loss_dev"] <= 1e-10 and row["param_dev"] <= 1e-10, row
        assert row["stage_set"] == (list(grid.stage_ranks(stage)) if grid.replicas > 1
                                    else None), row
        ends = sorted(grid.stage_ranks(0) + grid.stage_ranks(stages - 1))
        if stage in (0, stages - 1):
            assert row["global_ends"] == (len(ends) == ranks), row
            assert row["global_ends"] or row["ends_set"] == ends, row
        else:
            assert row["ends_set"] is None, row
        if ranks == 4:
            assert "Horovod process set of ranks [0, 3]" in row["second"], row
            assert "HOROVOD_DYNAMIC_PROCESS_SETS=1" in row["second"], row


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "ranks"),
                         [("gpipe", 2), ("interleaved-1f1b", 2), ("1f1b", 4)])
def test_pipeline_equals_the_reference(launch, tmp_path, schedule, ranks):
    """MLP + SGD and a tied GPT + Adam, float64, 2 stages x 4 micro-batches, D = ranks / 2
    (interleaved: 2 chunks per stage of 4-layer models); evaluation through the pipeline."""
    job = launch("any", ranks, [WORKER, "equivalence", schedule, str(tmp_path)],
                 timeout=400)
    check_equivalence(results(job, ranks), schedule, ranks)


@pytest.mark.long
@pytest.mark.slow
def test_measured_bubble_and_peak_activations(launch, tmp_path):
    """S = 2, M = 8: the measured idle fraction of GPipe and 1F1B beside (S-1)/(M+S-1) = 1/9,
    and 1F1B holds fewer micro-batches' activations than GPipe (8 on every stage), measured.

    On a quiet machine the measured bubble comes within a few hundredths of the formula; on a
    shared 2-core box each round's alltoall and uneven compute add idle time, so the bound here
    is only that the stages overlapped: no better than the formula, clearly below the 1/2 of
    two stages taking turns."""
    job = launch("any", 2, [WORKER, "bubble", str(tmp_path)], timeout=400)
    row = results(job, 2)[0]
    formula = toolkit.bubble_formula("1f1b", 2, 8)[1]
    gpipe, one_f = row["pipeline:2:8:gpipe"], row["pipeline:2:8:1f1b"]
    print(json.dumps(row))
    for measured in (gpipe["bubble"], one_f["bubble"]):
        assert formula - 0.03 <= measured <= 0.45, row
    assert gpipe["peak"] == {"0": 8, "1": 8} and gpipe["held"] == 8, row
    assert one_f["peak"] == {"0": 2, "1": 1} and one_f["held"] == 2, row


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["horovod-torch", "horovod-tf"])
def test_bf16_activations_travel_in_half_the_bytes(launch, backend):
    """The digits MLP (64-128-10) under Pipeline(2, 4): each micro-batch's hidden activation
    (16 x 128, bfloat16 under autocast or TensorFlow's casts) and its gradient go as their
    16-bit values, two to a float32 element of the round's buffer; in float32 each value takes
    a whole element. Per rank and step: 4 messages, each a 3-element header and its values.
    An evaluation hands its 16-bit activations on the same way."""
    job = launch("any", 2, [WORKER, "message_bytes", backend], timeout=400)
    values = 16 * 128
    for row in results(job, 2):
        assert row["32"] == 4 * (3 + values) * 4, row
        assert row["bf16-mixed"] == 4 * (3 + values // 2) * 4, row
        assert row["eval bf16-mixed"] == pytest.approx(row["eval 32"], rel=1e-2), row


@pytest.mark.slow
def test_a_weight_tied_across_the_end_stages_trains_as_data_parallel(launch):
    """A float64 nn.Sequential whose head is its embedding (GPT-2's tie: one Parameter in two
    layers), cut into 2 stages under GPipe, 1F1B and interleaved 1F1B: the end stages sum the
    tied weight's gradients, so every schedule's losses and final state equal data parallel's,
    under data parallel's names, and both stages' copies stay equal. Untied, each stage's copy
    trained apart: the losses left data parallel's from the second step."""
    rows = results(launch("any", 2, [WORKER, "tied"], timeout=400), 2)
    schedules = ("pipeline:2:4:gpipe", "pipeline:2:4:1f1b", "pipeline:2:4:interleaved-1f1b:2")
    for row in rows:
        # the tie has one name in data parallel's state (torch's first), and the pipeline's
        assert "params/0.weight" in row["names"] and "params/7.weight" not in row["names"]
        for layout in schedules:
            assert row[layout]["same_names"], (layout, row)
            assert row[layout]["loss_dev"] <= 1e-10, (layout, row)
            assert row[layout]["param_dev"] <= 1e-10, (layout, row)
            assert row[f"{layout} tied"] == ["0.weight"], (layout, row)
    for layout in schedules:  # stage 0's embedding and stage 1's head: the same values
        assert rows[0][f"{layout} copy"] == rows[1][f"{layout} copy"], layout


# ------------------------------------------------------------------------ bad input (1 rank)
def test_world_size_not_a_multiple_of_the_stages():
    (x, y), _ = load_digits()
    trainer = toolkit.Trainer(pipelined_adapter(), MLP((64, 16, 10)), SGD(lr=0.1),
                              layout=Pipeline(2, 4), global_batch_size=16, max_steps=1,
                              progress=False, env=toolkit.LaunchEnv())
    with pytest.raises(ToolkitError, match="world size 1 is not a multiple of the 2 pipeline"):
        trainer.fit(x, y)


def test_micro_batches_must_divide_the_local_batch():
    (x, y), _ = load_digits()
    trainer = toolkit.Trainer(pipelined_adapter(), MLP((64, 16, 10)), SGD(lr=0.1),
                              layout="pipeline:1:5", global_batch_size=16, max_steps=1,
                              progress=False, env=toolkit.LaunchEnv())
    with pytest.raises(ToolkitError, match="5 micro-batches do not divide the local batch of 16"):
        trainer.fit(x, y)


@pytest.fixture(scope="module")
def torch_adapter():
    adapter = adapters.get("horovod-torch")
    adapter.setup(toolkit.LaunchEnv())
    return adapter


def test_a_native_model_must_be_sequential(torch_adapter):
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.b(self.a(x))

    pipe = TorchPipeline(torch_adapter.runtime, Pipeline(1, 2))
    with pytest.raises(ToolkitError, match="Net into pipeline stages: it is not a torch.nn.Seq"):
        pipe.build(Net(), SGD(lr=0.1), "cross_entropy")


def test_a_native_sequential_runs_on_one_stage(torch_adapter):
    """The index cut of a native nn.Sequential, and its state under torch's own names."""
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    pipe = TorchPipeline(torch_adapter.runtime, Pipeline(1, 2, "gpipe"))
    pipe.build(net, SGD(lr=0.1, momentum=0.9), "cross_entropy")
    x = np.random.default_rng(0).normal(size=(6, 4)).astype(np.float32)
    y = np.array([0, 1, 2, 0, 1, 2])
    loss = float(pipe.train_step(x, y, 0.1))
    assert np.isfinite(loss)
    state = pipe.state_dict()
    assert {"params/0.weight", "params/2.bias", "opt/momentum/2.weight", "rng/step"} <= set(state)
    sums = pipe.evaluate(x, y)
    assert sums["count"] == 6.0 and sums["loss_sum"] / 6 < loss


def test_an_adapter_without_the_ability_is_told_what_it_runs():
    class Plain:
        name = "some-backend"

    with pytest.raises(ToolkitError, match="cannot run layout 'pipeline:2:4:1f1b'") as err:
        resolve_layout("pipeline:2:4", Plain())
    assert "HINT: some-backend runs: data_parallel; choose one of these, or a backend that " \
           "runs this layout" in str(err.value)
    assert "pipeline" in adapters.get("horovod-torch").layouts
