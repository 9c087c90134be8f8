"""horovod-tf's pipeline stages (adapters/horovod_tf/pipeline.py): equal to the float64
reference under GPipe, 1F1B and interleaved 1F1B (one and two replicas) on the MLP and a tied
GPT, float32 within the equivalence command's bounds, checkpoints of every rank's pieces read
back as the full model and resumed identically, and bad input.

The multi-rank float64 checks run tests/scripts/pipeline_torch_worker.py with the backend
``horovod-tf`` (the same checks as horovod-torch's); the float32 ones the equivalence command.
"""

import json
import re
import time

import numpy as np
import pytest
from test_pipeline_torch import check_equivalence, results

import adapters
import toolkit
from toolkit import MLP, SGD, Pipeline, ToolkitError
from toolkit.contract import PipelineAdapter
from toolkit.datasets import load_digits
from toolkit.equivalence import LOSS_TOLERANCE, PARAM_TOLERANCE
from toolkit.parallel.pipeline.timeline import peak_in_flight

WORKER = "tests/scripts/pipeline_torch_worker.py"


def check_worker(launch, tmp_path, schedule: str, ranks: int) -> list[dict]:
    job = launch("any", ranks,
                 [WORKER, "equivalence", schedule, str(tmp_path), "horovod-tf"], timeout=400)
    rows = results(job, ranks)
    check_equivalence(rows, schedule, ranks)
    # SGD with momentum: one slot per parameter of the stage
    assert all(r["mlp"]["bytes"]["optimizer"] == r["mlp"]["bytes"]["params"] for r in rows)
    return rows


@pytest.mark.slow
def test_1f1b_equals_the_reference_at_two_ranks(launch, tmp_path):
    """MLP + SGD and a tied GPT + Adam, float64, 2 stages x 4 micro-batches, one replica;
    checkpoint, resume and evaluation through the pipeline."""
    check_worker(launch, tmp_path, "1f1b", 2)


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "ranks"),
                         [("gpipe", 2), ("interleaved-1f1b", 2), ("gpipe", 4), ("1f1b", 4)])
def test_pipeline_equals_the_reference(launch, tmp_path, schedule, ranks):
    """As above for GPipe, interleaved 1F1B (2 chunks per stage of 4-layer models) and two
    replicas of each stage (D = 2: gradients averaged within each stage's replicas)."""
    check_worker(launch, tmp_path, schedule, ranks)


def run_equivalence(launch, tmp_path, *args) -> dict:
    out = tmp_path / "eq.json"
    job = launch("python", 1, ["-m", "adapters.equivalence", "--json", str(out),
                               "--backends", "horovod-tf", "--world-sizes", "2", *args],
                 timeout=600)
    assert job.returncode == 0, job
    return json.loads(out.read_text())


def check_passes(report: dict, layouts: list[str]) -> None:
    rows = {r["layout"]: r for r in report["results"]}
    assert sorted(rows) == sorted(layouts), report
    for r in rows.values():
        assert r["status"] == "pass", r
        assert r["max_rel_loss_dev"] <= LOSS_TOLERANCE["float32"], r
        assert r["max_abs_param_dev"] <= PARAM_TOLERANCE["float32"], r
    # both schedules compute the same thing: their losses agree to float32 rounding
    losses = np.array([r["losses"] for r in rows.values()])
    assert np.max(np.abs(losses - losses[0]) / np.abs(losses[0])) <= 1e-6


@pytest.mark.long  # tests/test_equivalence.py runs this command for every backend in CI
@pytest.mark.slow
def test_equivalence_command_gpipe_and_1f1b_float32(launch, tmp_path):
    """The MLP preset, 20 steps, global batch 64, float32: `python -m adapters.equivalence
    --backends horovod-tf --layout pipeline:2:4:gpipe,pipeline:2:4:1f1b --world-sizes 2`."""
    layouts = ["pipeline:2:4:gpipe", "pipeline:2:4:1f1b"]
    check_passes(run_equivalence(launch, tmp_path, "--steps", "20", "--layout",
                                 ",".join(layouts)), layouts)


@pytest.mark.long
@pytest.mark.slow
def test_equivalence_command_tied_gpt_float32(launch, tmp_path):
    layouts = ["pipeline:2:4:gpipe", "pipeline:2:4:1f1b"]
    check_passes(run_equivalence(launch, tmp_path, "--steps", "10", "--model", "gpt",
                                 "--optimizer", "adam", "--layout", ",".join(layouts)), layouts)


@pytest.mark.long
@pytest.mark.slow
def test_a_rank_killed_mid_schedule_ends_the_job(launch):
    job = launch("horovodrun-gloo", 2, [WORKER, "crash", "horovod-tf"], timeout=120,
                 env={"CRASH_RANK": "0"})
    ended = time.time()
    killed = re.search(r"killing rank 0 at B1 at time ([0-9.]+)", job.stdout)
    assert killed and job.returncode != 0, job
    assert ended - float(killed.group(1)) < 60, job  # the other rank ends too, no hang


# ------------------------------------------------------------------------ bad input (1 rank)
def test_the_adapter_has_the_ability():
    assert isinstance(adapters.get("horovod-tf"), PipelineAdapter)
    assert "pipeline" in adapters.get("horovod-tf").layouts


@pytest.mark.parametrize(("layout", "error"), [
    (Pipeline(2, 4), "world size 1 is not a multiple of the 2 pipeline stages"),
    ("pipeline:1:5", "5 micro-batches do not divide the local batch of 16")])
def test_the_trainer_refuses_a_layout_that_does_not_fit(layout, error):
    (x, y), _ = load_digits()
    with pytest.raises(ToolkitError, match=error):
        toolkit.Trainer(adapters.get("horovod-tf"), MLP((64, 16, 10)), SGD(lr=0.1),
                        layout=layout, global_batch_size=16, max_steps=1, progress=False,
                        env=toolkit.LaunchEnv()).fit(x, y)


@pytest.fixture(scope="module")
def tf_adapter():
    """One set-up horovod-tf adapter (one rank), given a new layout by each test."""
    return _set_up(adapters.get("horovod-tf"))


def _set_up(adapter):
    adapter.setup(toolkit.LaunchEnv())
    return adapter


def pipelined(adapter, layout, model, optimizer=None):
    adapter.setup(toolkit.LaunchEnv(), layout)
    adapter.build(model, optimizer or SGD(lr=0.1, momentum=0.9), "cross_entropy")
    return adapter


def test_micro_batches_must_divide_the_local_batch(tf_adapter):
    (x, y), _ = load_digits()
    adapter = pipelined(tf_adapter, Pipeline(1, 5), MLP((64, 16, 10)))
    with pytest.raises(ToolkitError, match="5 micro-batches do not divide the local batch of 16"):
        adapter.train_step(x[:16], y[:16], 0.1)
    assert float(adapter.train_step(x[:15], y[:15], 0.1)) > 0  # 5 micro-batches of 3 run


def test_a_backward_sums_its_gradients_in_the_next_wait(tf_adapter):
    """One step of Pipeline(1, 4, "1f1b") against Pipeline(1, 1) from the same initial values:
    equal parameters (B(m)'s gradients summed once each), and each B(m) recorded in two parts,
    the sums after the next forward (a stage that waits for no message sums them before its
    next backward); the peak in flight counts each backward once."""
    (x, y), _ = load_digits()
    runs = []
    for layout in (Pipeline(1, 4, "1f1b"), Pipeline(1, 1)):
        adapter = pipelined(tf_adapter, layout, MLP((64, 16, 10)))
        adapter.train_step(x[:16], y[:16], 0.1)
        runs.append((adapter.state_dict(), list(adapter.strategy.recorder.records)))
    (four, records), (one, _) = runs
    for k, v in four.items():
        if k.startswith("params/"):
            np.testing.assert_allclose(v, one[k], rtol=0, atol=1e-6, err_msg=k)
    parts = {m: [r for r in records if r["action"] == f"B{m}"] for m in range(4)}
    assert all(len(p) == 2 and p[0]["end"] <= p[1]["start"] for p in parts.values()), parts
    forwards = {r["micro_batch"]: r for r in records if r["action"][0] == "F"}
    for m in range(3):
        assert parts[m][1]["start"] >= forwards[m + 1]["end"], records
    assert peak_in_flight(records) == {0: 1}


def test_a_native_model_must_be_sequential(tf_adapter):
    import keras

    inputs = keras.Input((4,))
    functional = keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Dense(4)(inputs)))
    with pytest.raises(ToolkitError, match="into pipeline stages: it is not a keras.Sequential"
                       ) as err:
        pipelined(tf_adapter, Pipeline(1, 2), functional)
    assert "a pipeline needs a sequential model" in str(err.value)


def test_a_keras_optimizer_that_reads_whole_tensors_is_refused(tf_adapter):
    """(Elementwise Keras optimizers run: tests/adapters/test_native_optimizers.py.)"""
    import keras

    net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    with pytest.raises(ToolkitError, match="cannot use the optimizer Lamb"):
        pipelined(tf_adapter, Pipeline(1, 2), net, keras.optimizers.Lamb(0.1))
    with pytest.raises(ToolkitError, match="optimizer Adafactor"):  # (a spec model's too)
        pipelined(tf_adapter, Pipeline(1, 2), MLP((4, 3)), keras.optimizers.Adafactor())


def test_a_keras_sequential_runs_on_one_stage(tf_adapter):
    """The index cut of a Keras Sequential, its state under the stable Keras names, and a
    state round trip that continues identically."""
    import keras

    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                            keras.layers.BatchNormalization(), keras.layers.Dense(3)])
    adapter = pipelined(tf_adapter, Pipeline(1, 2, "gpipe"), net)
    x = np.random.default_rng(0).normal(size=(6, 4)).astype(np.float32)
    y = np.array([0, 1, 2, 0, 1, 2])
    loss = float(adapter.train_step(x, y, 0.1))
    assert np.isfinite(loss)
    state = adapter.state_dict()
    names = {k.split("/", 1)[1] for k in state if k.startswith("params/")}
    assert names == {f"sequential/{layer}/{v}" for layer, v in (
        ("dense", "kernel"), ("dense", "bias"), ("batch_normalization", "gamma"),
        ("batch_normalization", "beta"), ("dense_1", "kernel"), ("dense_1", "bias"))}
    assert any(k.startswith("buffers/") and "moving_mean" in k for k in state), sorted(state)
    assert {"rng/step", *(f"opt/momentum/{n}" for n in names)} <= set(state)
    sums = adapter.evaluate(x, y)
    assert sums["count"] == 6.0 and np.isfinite(sums["loss_sum"])
    second = float(adapter.train_step(x, y, 0.1))
    adapter.load_state_dict(state)  # back to after the first step: the same second step
    assert float(adapter.train_step(x, y, 0.1)) == second


@pytest.mark.long
@pytest.mark.slow
def test_a_keras_sequential_cut_into_two_stages_equals_data_parallel(launch):
    """Float64 Dense 64-32-32-10, each rank drawing other initial values (rank 0's are
    broadcast before the cut): Pipeline(2, 4, "1f1b") trains as data parallel does."""
    rows = results(launch("any", 2, [WORKER, "keras"], timeout=400), 2)
    for row in rows:
        assert row["same_names"] and len(row["names"]) == 6, row
        assert row["loss_dev"] <= 1e-10 and row["param_dev"] <= 1e-10, row
    # the first Dense layer on stage 0, the other two on stage 1 (balanced by parameters)
    assert [r["params"] for r in rows] == [(64 * 32 + 32) * 8,
                                           (32 * 32 + 32 + 32 * 10 + 10) * 8]
