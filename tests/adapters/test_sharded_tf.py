"""horovod-tf under sharded layouts (ZeRO 1-3 / FSDP): its collectives against numpy with chunks
of at least 1 MiB under Gloo and MPI, the bytes each rank holds, its checkpoint pieces, stage
equivalence with accumulation/custom loss/metrics/evaluation, and the refusals.

The generic equivalence and resume tests of every sharded backend are tests/test_sharded.py's.
"""


import numpy as np
import pytest

import adapters
import toolkit

WORKER = "tests/scripts/sharded_tf_worker.py"


def test_tensor_parallel_is_refused_clearly():
    adapter = adapters.get("horovod-tf")
    with pytest.raises(toolkit.ToolkitError, match="tensor_parallel=2") as err:
        adapter.setup(toolkit.LaunchEnv(), toolkit.Sharded(stage=3, tensor_parallel=2))
    assert "only jax-pjit splits layers" in str(err.value)


def test_what_a_sharded_layout_cannot_take_is_refused_clearly():
    """A Keras model shards (tests/adapters/test_keras_sharded.py); a model that is neither a
    spec nor a Keras model, an optimizer that is not elementwise, and weight-decay exclusions
    (a flat shard holds many variables) are refused."""
    import keras

    x, y = np.zeros((4, 4), np.float32), np.zeros(4, np.int64)

    def fit(model, optimizer, layout):
        toolkit.Trainer(adapters.get("horovod-tf"), model, optimizer, global_batch_size=4,
                        max_steps=1, layout=layout, progress=False).fit(x, y)

    fit(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]), toolkit.SGD(lr=0.1),
        "sharded:2")
    with pytest.raises(toolkit.ToolkitError, match="cannot shard a Module") as err:
        fit(tf_module(), toolkit.SGD(lr=0.1), "sharded:2")
    assert "toolkit.MLP, toolkit.CNN and toolkit.GPT, or a built Keras 3 model" in str(err.value)
    with pytest.raises(toolkit.ToolkitError, match="cannot use the optimizer Lamb"):
        fit(toolkit.MLP((4, 2)), keras.optimizers.Lamb(0.1), "sharded:1")
    adamw = keras.optimizers.AdamW(0.1)
    adamw.exclude_from_weight_decay(var_names=["bias"])
    with pytest.raises(toolkit.ToolkitError, match="excluded from weight decay") as err:
        fit(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]), adamw, "sharded:3")
    assert "decay every variable, or use the data-parallel layout" in str(err.value)


def tf_module():
    import tensorflow as tf

    class Module(tf.Module):
        def __call__(self, x):
            return x

    return Module()


def test_one_rank_state_round_trips_and_data_parallel_reports_its_bytes():
    """World size 1: state_dict/load_state_dict speak full tensors under every stage."""
    spec = toolkit.MLP((8, 16, 4))
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(6, 8)), rng.integers(0, 4, size=6)
    states = []
    for stage in (1, 2, 3):
        adapter = adapters.get("horovod-tf", dtype="float64")
        adapter.setup(toolkit.LaunchEnv(), toolkit.Sharded(stage))
        adapter.build(spec, toolkit.Adam(lr=0.1), "cross_entropy", seed=1)
        adapter.train_step(x, y, 0.1)
        state = adapter.state_dict()
        fresh = {k: np.zeros_like(v) for k, v in state.items()}
        adapter.load_state_dict(fresh)
        assert all(not np.any(v) for k, v in adapter.state_dict().items() if k != "opt/count")
        adapter.load_state_dict(state)
        assert adapter.state_dict().keys() == state.keys()
        for k, v in adapter.state_dict().items():
            np.testing.assert_array_equal(v, state[k])
        states.append(state)
    for k in states[0]:  # one rank: every stage takes the same step
        np.testing.assert_allclose(states[1][k], states[0][k], rtol=0, atol=1e-14)
        np.testing.assert_allclose(states[2][k], states[0][k], rtol=0, atol=1e-14)
    dp = adapters.get("horovod-tf")
    dp.setup(toolkit.LaunchEnv())
    dp.build(spec, toolkit.Adam(lr=0.1), "cross_entropy")
    params = 4 * (8 * 16 + 16 + 16 * 4 + 4)
    assert dp.memory_bytes() == {"params": params, "grads": params, "optimizer": 2 * params}
    with pytest.raises(toolkit.ToolkitError, match="needs a sharded layout"):
        dp.sharded_state()


TRANSPORTS = {"gloo": {"gloo": True, "mpi": False, "gloo_rendezvous": True},
              "mpi": {"gloo": False, "mpi": True, "gloo_rendezvous": False}}


def run_worker(launch, launcher, nproc, parts, transport):
    """The worker's results by rank, after checking that every rank's Horovod ran its
    collectives over ``transport`` ("gloo" or "mpi")."""
    job = launch(launcher, nproc, [WORKER, ",".join(parts)], timeout=600)
    assert job.returncode == 0, job
    results = sorted(job.results, key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == list(range(nproc)), job
    for r in results:
        assert r["size"] == nproc, r["size"]
        assert r["transport"] == TRANSPORTS[transport], (r["rank"], r["transport"])
    return results


def check_collectives(results):
    for r in results:
        c = r["collectives"]
        assert c["rs_shape"] == [262147], c  # > 1 MiB of float32 per rank
        assert c["rs_average_dev"] < 1e-6, c
        assert c["rs_sum_dev"] < 3e-6, c
        assert c["allgather_equal"], c
        g = r["gradients"]
        assert g["unit_shard_bytes"] >= 1 << 20, g
        for stage in (1, 2, 3):
            got = g[f"grad_stage{stage}"]
            assert got["shape"] == got["want_shape"], got
            assert got["rel_dev"] < 1e-5, (stage, got)


def check_state(results, size):
    for stage in (1, 2, 3):
        rows = [r["state"][f"stage{stage}"] for r in results]
        for row in rows:
            assert row["memory"] == row["want"], (stage, row["memory"], row["want"])
            assert row["initial_is_rank0_seed"], stage
            assert ("params/layers.0.kernel" in row["replicated"]) == (stage < 3), row["replicated"]
            assert "opt/count" in row["replicated"]
        if stage == 3:  # parameters exist only as equal flat shards
            assert all(len(s) == 1 for s in rows[0]["param_variable_shapes"]), rows[0]
        # Every rank's pieces, in rank order, are the full tensors (empty where none owned):
        # the slots' (and in stage 3 the parameters'); stages 1/2 replicate the parameters.
        full, pieces = rows[0]["full"], [row["pieces"] for row in rows]
        params = {k for k in full if k.startswith("params/")}
        assert set(pieces[0]) == (set(full) if stage == 3 else set(full) - params)
        assert params & set(rows[0]["replicated"]) == (set() if stage == 3 else params)
        for name in pieces[0]:
            values = full[name]
            joined = np.concatenate([np.asarray(p[name][0], np.float32) for p in pieces])
            assert [p[name][1] for p in pieces] == [0] * size
            np.testing.assert_array_equal(joined, np.asarray(values, np.float32), err_msg=name)
        for row in rows[1:]:  # state_dict gathers: the same full tensors on every rank
            assert row["full"] == full


def check_layouts(results):
    for r in results:
        for name, row in r["layouts"].items():
            assert row["loss_dev"] < 1e-12, (name, row)
            assert row["param_dev"] < 1e-12, (name, row)
            assert row["eval_dev"] < 1e-12, (name, row)
        assert r["layouts"]["mlp_stage3"]["eval_keys"] == ["val_loss", "val_margin"]
        assert r["layouts"]["gpt_stage3"]["eval_keys"] == ["val_accuracy", "val_loss"]


@pytest.mark.long
@pytest.mark.slow
def test_three_ranks_under_gloo(launch):
    results = run_worker(launch, "horovodrun-gloo", 3,
                         ["collectives", "gradients", "state", "layouts"], "gloo")
    check_collectives(results)
    check_state(results, 3)
    check_layouts(results)


@pytest.mark.long
@pytest.mark.slow
def test_two_ranks_under_mpi(launch):
    """The collectives and the gradient shards again, over MPI (state and layouts do not
    depend on the transport)."""
    results = run_worker(launch, "horovodrun-mpi", 2, ["collectives", "gradients"], "mpi")
    check_collectives(results)
