"""Native Keras 3 models in horovod-tf with all of their state: BatchNormalization statistics,
Keras optimizers, Dropout randomness across kill-and-resume, custom losses, token models."""

import re

import numpy as np
import pytest

import adapters
import toolkit
from toolkit import SGD, LaunchEnv, ToolkitError
from toolkit.datasets import load_digits

ENV = LaunchEnv()


def digits():
    (x, y), (vx, vy) = load_digits()
    return (x.reshape(-1, 8, 8, 1), y), (vx.reshape(-1, 8, 8, 1), vy)


def keras_cnn(dropout=0.3, seed=0):
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((8, 8, 1)), keras.layers.Conv2D(6, 3, padding="same", activation="relu"),
        keras.layers.BatchNormalization(momentum=0.9), keras.layers.Dropout(dropout),
        keras.layers.Flatten(), keras.layers.Dense(10)])


def keras_adam():
    import keras

    schedule = keras.optimizers.schedules.ExponentialDecay(0.01, decay_steps=5, decay_rate=0.8)
    return keras.optimizers.Adam(schedule)


def make():
    adapter = adapters.get("horovod-tf")
    adapter.setup(ENV)
    return adapter


def trainer(adapter, model, optimizer, steps, **kw):
    return toolkit.Trainer(adapter, model, optimizer, global_batch_size=32, max_steps=steps,
                           progress=False, env=ENV, **kw)


def test_keras_cnn_with_batchnorm_and_dropout_trains_with_a_keras_optimizer():
    import keras

    (x, y), val = digits()
    fresh = make()
    fresh.build(keras_cnn(), keras.optimizers.SGD(0.05, momentum=0.9), "cross_entropy")
    before = fresh.state_dict()
    adapter = make()
    t = trainer(adapter, keras_cnn(), keras.optimizers.SGD(0.05, momentum=0.9), 40)
    history = t.fit(x, y)
    assert np.mean(history.losses[-5:]) < 0.5 * np.mean(history.losses[:5])
    assert t.evaluate(*val)["val_accuracy"] > 0.5
    after = adapter.state_dict()
    assert after.keys() == before.keys()
    prefix = "sequential/batch_normalization/"
    for name in ("moving_mean", "moving_variance"):
        key = f"buffers/{prefix}{name}"
        assert after[key].shape == (6,)
        assert not np.array_equal(after[key], before[key]), key
    assert int(after["opt/iteration"]) == 40 and int(before["opt/iteration"]) == 0
    assert f"params/{prefix}gamma" in after and "params/sequential/conv2d/kernel" in after
    momentum = {k for k in after if k.startswith("opt/momentum/")}
    assert momentum == {"opt/momentum/" + k[len("params/"):] for k in after
                        if k.startswith("params/")}
    assert after["rng/step"] == 40
    # Evaluation uses the moving statistics, so it is a function of the state alone.
    other = make()
    other.build(keras_cnn(), keras.optimizers.SGD(0.05, momentum=0.9), "cross_entropy")
    other.load_state_dict(after)
    assert other.evaluate(*val) == adapter.evaluate(*val)


def test_state_names_do_not_depend_on_how_many_models_the_process_built():
    import keras

    first, second = make(), make()
    first.build(keras_cnn(), keras_adam(), "cross_entropy")
    second.build(keras_cnn(), keras_adam(), "cross_entropy")  # Keras calls it sequential_<n>
    assert first.state_dict().keys() == second.state_dict().keys()
    assert "opt/velocity/sequential/dense/kernel" in first.state_dict()
    assert keras.Sequential().name != "sequential"  # the process numbers its models


@pytest.mark.parametrize("optimizer", ["keras-adam-schedule", "toolkit-sgd"])
def test_kill_and_resume_is_bit_for_bit_with_batchnorm_dropout_and_optimizer(optimizer,
                                                                              tmp_path):
    def opt():
        return keras_adam() if optimizer == "keras-adam-schedule" else \
            SGD(lr=0.05, momentum=0.9)

    (x, y), _ = digits()
    straight = make()
    trainer(straight, keras_cnn(), opt(), 20).fit(x, y)
    first = make()
    trainer(first, keras_cnn(), opt(), 10, checkpoint_dir=tmp_path, checkpoint_every=10).fit(x, y)
    second = make()
    history = trainer(second, keras_cnn(seed=7), opt(), 20, checkpoint_dir=tmp_path,
                      resume="latest").fit(x, y)
    assert history.first_step == 10
    want, got = straight.state_dict(), second.state_dict()
    assert got.keys() == want.keys()
    assert any(k.startswith("buffers/") for k in got) and any(k.startswith("opt/") for k in got)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_dropout_draws_differ_between_steps_but_not_between_runs():
    """The per-step seed really reaches Keras's Dropout (else resume equality is vacuous)."""
    import keras

    (x, y), _ = digits()
    batch = (x[:32], y[:32])
    runs = []
    for _ in range(2):
        adapter = make()
        adapter.build(keras_cnn(dropout=0.5), keras.optimizers.SGD(0.0), "cross_entropy")
        runs.append([float(adapter.train_step(*batch, None)) for _ in range(3)])
    assert runs[0] == runs[1]
    assert len(set(runs[0])) == 3  # same batch, same weights: only the dropout masks differ
    adapter = make()
    adapter.build(keras_cnn(dropout=0.0), keras.optimizers.SGD(0.0), "cross_entropy")
    assert float(adapter.train_step(*batch, None)) != runs[0][0]
    seeds = adapter.strategy.keras_model.seeds
    assert not np.array_equal(seeds(0, 5, 0), seeds(0, 5, 1))  # ranks draw differently


def test_a_custom_loss_equals_the_builtin_one_it_reimplements():
    import tensorflow as tf

    def loss(out, labels):
        return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=out)

    (x, y), val = digits()
    a = make()
    builtin = trainer(a, keras_cnn(), SGD(lr=0.05, momentum=0.9), 8)
    b = make()
    custom = trainer(b, keras_cnn(), SGD(lr=0.05, momentum=0.9), 8, loss=loss)
    np.testing.assert_allclose(custom.fit(x, y).losses, builtin.fit(x, y).losses, rtol=1e-6)
    assert b.evaluate(*val)["loss_sum"] == pytest.approx(a.evaluate(*val)["loss_sum"], rel=1e-6)


def test_a_loss_with_the_wrong_shape_is_a_clear_error():
    import tensorflow as tf

    (x, y), _ = digits()
    t = trainer(make(), keras_cnn(), SGD(lr=0.1), 2,
                loss=lambda out, labels: tf.reduce_mean(out))
    with pytest.raises(ToolkitError) as err:
        t.fit(x, y)
    assert re.search(r"returned shape \(\) for a batch of 32 samples", str(err.value))
    assert "HINT" in str(err.value)


def test_an_unbuilt_keras_model_is_a_clear_error():
    import keras

    model = keras.Sequential([keras.layers.Dense(10)])  # no keras.Input: no variables yet
    with pytest.raises(ToolkitError, match="is not built") as err:
        make().build(model, SGD(lr=0.1), "cross_entropy")
    assert "keras.Input" in str(err.value) and "model(x[:1])" in str(err.value)


def test_a_keras_optimizer_built_over_other_variables_is_refused():
    import keras

    stranger = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    opt = keras.optimizers.Adam()
    opt.build(stranger.trainable_variables)
    with pytest.raises(ToolkitError, match="already built over 2 variables that are not") as e:
        make().build(keras_cnn(), opt, "cross_entropy")
    assert "fresh optimizer" in str(e.value)


@pytest.mark.parametrize("layout", [None, "sharded:1", "sharded:3", "pipeline:1:2"])
def test_a_keras_optimizer_trains_a_spec_model_as_the_spec_optimizer_does(layout):
    """Keras SGD with momentum over the toolkit's MLP (its variables, or this rank's flat
    shards) is the spec's SGD; its slots are saved under the neutral names."""
    import keras

    (x, y), _ = load_digits()
    spec = toolkit.MLP((64, 16, 10))
    adapter = adapters.get("horovod-tf", dtype="float64")
    native = trainer(adapter, spec, keras.optimizers.SGD(0.1, momentum=0.9), 5, layout=layout)
    losses = native.fit(x, y).losses
    want = trainer(adapters.get("horovod-tf", dtype="float64"), spec,
                   SGD(lr=0.1, momentum=0.9), 5, layout=layout).fit(x, y).losses
    np.testing.assert_allclose(losses, want, rtol=1e-9)  # (Keras: v = m v - lr g; w += v)
    state = adapter.state_dict()
    assert {"opt/momentum/layers.0.kernel", "opt/iteration"} <= set(state), sorted(state)


def test_sync_batchnorm_on_one_rank_is_keras_batchnorm():
    (x, y), _ = digits()
    plain = trainer(make(), keras_cnn(), SGD(lr=0.05), 5).fit(x, y).losses
    model = keras_cnn()
    synced = trainer(make(), model, SGD(lr=0.05), 5, sync_batchnorm=True).fit(x, y).losses
    assert synced == plain
    assert model.layers[1]._toolkit_sync_bn  # converted in place


def test_a_keras_model_of_another_dtype_is_a_clear_error():
    adapter = adapters.get("horovod-tf", dtype="float64")
    adapter.setup(ENV)
    with pytest.raises(ToolkitError, match="variables are float32 but the backend runs "
                                           "float64") as err:
        adapter.build(keras_cnn(), SGD(lr=0.1), "cross_entropy")
    assert "set_floatx('float64')" in str(err.value)


def test_a_token_model_trains_per_token_and_evaluates_per_position():
    """Embedding + MultiHeadAttention + LayerNormalization on int token ids; cross_entropy is
    the mean over each sample's tokens, ``correct`` the fraction of right positions."""
    import keras

    keras.utils.set_random_seed(0)
    vocab, length = 13, 6
    ids = keras.Input((length,), dtype="int32")
    h = keras.layers.Embedding(vocab, 8)(ids)
    h = keras.layers.LayerNormalization()(h + keras.layers.MultiHeadAttention(2, 4)(h, h))
    model = keras.Model(ids, keras.layers.Dense(vocab)(keras.layers.Dropout(0.1)(h)))
    rng = np.random.default_rng(0)
    x = rng.integers(0, vocab, size=(64, length))
    y = np.roll(x, -1, axis=1)
    adapter = make()
    history = trainer(adapter, model, keras_adam(), 30).fit(x, y)
    assert history.losses[-1] < history.losses[0]
    names = adapter.state_dict()
    assert any("multi_head_attention/query/kernel" in k for k in names)
    assert any(k.startswith("params/") and "embedding/embeddings" in k for k in names)
    result = adapter.evaluate(x[:5], y[:5])
    logits = model(x[:5], training=False).numpy().astype(np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    token_losses = -np.take_along_axis(logp, y[:5, :, None], axis=-1)[..., 0]
    assert result["count"] == 5
    assert result["loss_sum"] == pytest.approx(token_losses.mean(1).sum(), rel=1e-5)
    assert result["correct"] == pytest.approx((logits.argmax(-1) == y[:5]).mean(1).sum())


def test_a_keras_checkpoint_resumes_into_horovod_tf_only(tmp_path):
    import torch

    (x, y), _ = digits()
    trainer(make(), keras_cnn(), SGD(lr=0.05), 3, checkpoint_dir=tmp_path).fit(x, y)
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    other = toolkit.Trainer(adapters.get("horovod-torch"), net, SGD(lr=0.05),
                            global_batch_size=32, max_steps=6, checkpoint_dir=tmp_path,
                            resume="latest", progress=False, env=ENV)
    with pytest.raises(ToolkitError) as err:
        other.fit(x, y)
    assert "holds a native model written by horovod-tf, but this run uses horovod-torch" in \
        str(err.value)
    assert "--backend horovod-tf" in str(err.value)
