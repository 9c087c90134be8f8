"""horovod-tf: a native Keras 3 model (Conv2D, BatchNormalization, Dropout) under sharded:1,
sharded:2 and sharded:3 on 2 ranks equals data parallel step by step (losses, parameters,
BatchNorm statistics, optimizer state); each rank holds the bytes ``toolkit.memory.estimate``
says plus the flat buffer's padding; a checkpoint moves between ``data`` and ``sharded:3``.

The 2-rank cases run this file as their worker (``python tests/adapters/test_keras_sharded.py
FOLDER``) once for the module; each rank writes one JSON record.
"""

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

import adapters
import toolkit
import toolkit.memory
from toolkit.datasets import load_digits

WORKER = "tests/adapters/test_keras_sharded.py"
STEPS, BATCH = 4, 32
LAYOUTS = ("data", "sharded:1", "sharded:2", "sharded:3")


def keras_cnn():
    """1,963 trainable parameters (odd: the flat buffer has one element of padding on 2 ranks)
    and BatchNormalization statistics, with Dropout; in Keras's floatx."""
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((8, 8, 1)), keras.layers.Conv2D(3, 3, padding="same", use_bias=False),
        keras.layers.BatchNormalization(momentum=0.9), keras.layers.ReLU(),
        keras.layers.Dropout(0.25), keras.layers.Flatten(), keras.layers.Dense(10)])


def keras_mlp():
    """29 trainable parameters (4*3 + 3, BatchNormalization's 2*3, 3*2 + 2)."""
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                             keras.layers.BatchNormalization(), keras.layers.Dense(2)])


def keras_dtype(name: str) -> None:
    """Keras builds the next models' variables in ``name`` (its floatx and the global dtype
    policy, which Keras fixes from floatx when it first builds a layer)."""
    import keras

    keras.config.set_floatx(name)
    keras.config.set_dtype_policy(name)


def digits():
    (x, y), _ = load_digits()
    return x.reshape(-1, 8, 8, 1), y


def trainer(layout, steps, **kw):
    import keras

    return toolkit.Trainer(adapters.get("horovod-tf", dtype="float64"), keras_cnn(),
                           keras.optimizers.SGD(0.05, momentum=0.9), global_batch_size=BATCH,
                           max_steps=steps, layout=layout, progress=False, **kw)


# ------------------------------------------------------------------------------ the worker
def _emit(result: dict) -> None:
    """One JSON line in ``$TOOLKIT_TEST_RESULTS/rank<R>.jsonl`` (tests/scripts/_emit.py's)."""
    rank = toolkit.current_env().rank
    with open(Path(os.environ["TOOLKIT_TEST_RESULTS"]) / f"rank{rank}.jsonl", "a") as f:
        f.write(json.dumps(result) + "\n")


def _lists(state: dict) -> dict:
    return {k: np.asarray(v).tolist() for k, v in state.items()}


def worker(folder: Path) -> None:
    env = toolkit.current_env()
    adapters.get("horovod-tf").setup(env)  # (before Keras starts TensorFlow)
    x, y = digits()
    out: dict = {"rank": env.rank, "losses": {}, "states": {}, "memory": {}, "resumed": {}}
    keras_dtype("float64")
    for layout in LAYOUTS:
        t = trainer(layout, STEPS)
        out["losses"][layout] = t.fit(x, y).losses
        out["states"][layout] = _lists(t.adapter.state_dict())
    for first, then in (("data", "sharded:3"), ("sharded:3", "data")):
        ckpt = folder / f"{first}-{then}".replace(":", "")
        # (every step: rank 1 then finds a checkpoint on disk at the end, whatever rank 0's
        # write of the last one has reached, and does not save again alone)
        trainer(first, STEPS // 2, checkpoint_dir=ckpt, checkpoint_every=1).fit(x, y)
        t = trainer(then, STEPS, checkpoint_dir=ckpt, resume="latest")
        history = t.fit(x, y)
        out["resumed"][f"{first}->{then}"] = {"first_step": history.first_step,
                                              "losses": history.losses,
                                              "state": _lists(t.adapter.state_dict())}
    keras_dtype("float32")
    rng = np.random.default_rng(0)
    mx, my = rng.normal(size=(8, 4)), rng.integers(0, 2, size=8)
    for stage in (1, 2, 3):
        adapter = adapters.get("horovod-tf")
        adapter.setup(env, toolkit.Sharded(stage))
        model = keras_mlp()
        adapter.build(model, toolkit.Adam(lr=0.01), "cross_entropy")
        adapter.train_step(mx[env.rank::2], my[env.rank::2], 0.01)
        variables = model.trainable_variables
        out["memory"][stage] = {
            "bytes": adapter.memory_bytes(),
            "count": sum(int(np.prod(v.shape)) for v in variables),
            "model_holds": sum(int(np.asarray(v.numpy()).size) for v in variables)}
    _emit(out)


# ------------------------------------------------------------------------------ 2 ranks
@pytest.fixture(scope="module")
def ranks(launch, tmp_path_factory):
    job = launch("any", 2, [WORKER, str(tmp_path_factory.mktemp("keras_sharded"))],
                 timeout=600)
    assert job.returncode == 0, job
    results = sorted(job.results, key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1], job
    return results


def assert_states_equal(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), (what, sorted(set(got) ^ set(want)))
    for name in want:
        np.testing.assert_allclose(np.asarray(got[name], np.float64),
                                   np.asarray(want[name], np.float64), rtol=0, atol=1e-12,
                                   err_msg=f"{what}: {name}")


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS[1:])
def test_every_stage_equals_data_parallel(ranks, layout):
    """Losses step by step, then parameters, BatchNorm statistics and the Keras optimizer's
    state under the names data parallel uses, on both ranks."""
    for r in ranks:
        np.testing.assert_allclose(r["losses"][layout], r["losses"]["data"], rtol=0, atol=1e-12)
        assert_states_equal(r["states"][layout], r["states"]["data"], f"rank {r['rank']}")
    state = ranks[0]["states"]["data"]
    stats = [k for k in state if k.startswith("buffers/") and k.endswith("moving_mean")]
    assert stats and all(np.any(np.asarray(state[k]) != 0) for k in stats), sorted(state)
    assert {"opt/iteration", "rng/step"} <= set(state)
    assert any(k.startswith("opt/momentum/") for k in state), sorted(state)
    assert ranks[0]["losses"]["data"] == ranks[1]["losses"]["data"]  # (averaged over ranks)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_each_rank_holds_the_estimate_plus_the_padding(ranks, stage):
    """toolkit.Adam (two slots per parameter) over 29 float32 parameters on 2 ranks: one
    flat buffer of 30 elements, 15 per rank; stage 3 leaves the model no weights of its own."""
    world = 2
    for r in ranks:
        row = r["memory"][str(stage)]
        count = row["count"]
        padding = -(-count // world) * world - count
        est = toolkit.memory.estimate(count, toolkit.Sharded(stage), world, "float32", "adam")
        want = {"params": est.params + (4 * padding / world if stage == 3 else 0),
                "grads": est.grads + 4 * padding / (1 if stage == 1 else world),
                "optimizer": est.optimizer + 2 * 4 * padding / world}
        assert (count, padding) == (29, 1)
        assert row["bytes"] == want, (stage, row["bytes"], want)
        assert row["model_holds"] == (0 if stage == 3 else count)


@pytest.mark.slow
def test_a_checkpoint_moves_between_data_parallel_and_sharded_3(ranks):
    """Saved after 2 steps under one layout, resumed under the other: the 2 steps after equal
    the uninterrupted run's (data parallel's). (Saving gives every rank rank 0's BatchNorm
    statistics, which the uninterrupted run never did: rank 1's are compared to rank 0's.)"""
    for r in ranks:
        want = {**r["states"]["data"], **{k: v for k, v in ranks[0]["states"]["data"].items()
                                          if k.startswith("buffers/")}}
        for move, got in r["resumed"].items():
            assert got["first_step"] == STEPS // 2, move
            np.testing.assert_allclose(got["losses"], r["losses"]["data"][STEPS // 2:],
                                       rtol=0, atol=1e-12, err_msg=move)
            assert_states_equal(got["state"], want, f"rank {r['rank']}, {move}")


# ------------------------------------------------------------------------------ 1 rank
def test_a_skipped_step_keeps_the_statistics_and_a_non_float_variable_is_refused():
    import keras

    x, y = digits()
    model = keras_cnn()  # (in the dtype this process's Keras builds in)
    dtype = str(model.trainable_variables[0].dtype)
    adapter = adapters.get("horovod-tf", dtype=dtype)
    adapter.setup(toolkit.LaunchEnv(), toolkit.Sharded(3))
    adapter.build(model, keras.optimizers.SGD(0.05), "cross_entropy", skip_nonfinite=True)
    adapter.train_step(x[:16], y[:16], None)
    before = adapter.state_dict()
    bad = x[:16].copy()
    bad[0, 0, 0, 0] = np.inf
    assert adapter.train_step(bad, y[:16], None).skipped
    after = adapter.state_dict()
    assert any(k.startswith("buffers/") for k in after)
    for name in before:
        if name != "rng/step":
            np.testing.assert_array_equal(after[name], before[name], err_msg=name)

    class Counter(keras.layers.Layer):
        def build(self, shape):
            self.count = self.add_weight(shape=(), dtype="int32", initializer="zeros")

        def call(self, inputs):
            return inputs

    model = keras.Sequential([keras.Input((4,)), Counter(), keras.layers.Dense(2)])
    adapter = adapters.get("horovod-tf", dtype=dtype)
    adapter.setup(toolkit.LaunchEnv(), toolkit.Sharded(2))
    with pytest.raises(toolkit.ToolkitError, match="trainable variable 'sequential.*/counter/"
                                                   "variable' is int32, and a sharded") as err:
        adapter.build(model, toolkit.SGD(lr=0.1), "cross_entropy")
    assert "layer.trainable = False" in str(err.value)


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
def test_mixed_precision_runs_through_the_keras_policy_as_data_parallel_does(precision):
    """One rank: sharded:3 (the model's stateless call on the gathered float32 buffer, each
    layer casting as its Keras policy says; fp16's loss scaling) takes data parallel's steps."""
    import keras

    x, y = digits()
    runs = {}
    for layout in ("data", "sharded:3"):
        model = keras_cnn()
        adapter = adapters.get("horovod-tf", dtype=str(model.trainable_variables[0].dtype),
                               precision=precision)
        t = toolkit.Trainer(adapter, model, keras.optimizers.SGD(0.05, momentum=0.9),
                            global_batch_size=BATCH, max_steps=3, layout=layout, progress=False)
        runs[layout] = (t.fit(x, y).losses, adapter.state_dict())
    (want, want_state), (got, got_state) = runs["data"], runs["sharded:3"]
    assert model.layers[0].dtype_policy.name.startswith("mixed_")
    np.testing.assert_array_equal(got, want)
    assert got_state.keys() == want_state.keys()
    for name in want_state:
        np.testing.assert_array_equal(got_state[name], want_state[name], err_msg=name)


if __name__ == "__main__":
    toolkit.run(lambda: worker(Path(sys.argv[1])))
