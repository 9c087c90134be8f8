"""All of a native model's state, not only its parameters: BatchNorm statistics, dropout
randomness, custom losses (torch and JAX here; TensorFlow in test_keras_native.py)."""

import re

import numpy as np
import pytest

import adapters
import toolkit
from toolkit import SGD, Adam, LaunchEnv, ToolkitError
from toolkit.datasets import load_digits

ENV = LaunchEnv()


def torch_net(dropout=0.3):
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.BatchNorm1d(32),
                               torch.nn.ReLU(), torch.nn.Dropout(dropout),
                               torch.nn.Linear(32, 10))


def flax_net(dropout=0.3):
    import flax.linen as nn
    import jax

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(nn.Dense(32)(x))
            x = nn.Dropout(dropout, deterministic=not train)(nn.relu(x))
            return nn.Dense(10)(x)

    net = Net()
    return net, net.init(jax.random.PRNGKey(0), np.zeros((1, 64), np.float32))


def make(backend, **kw):
    adapter = adapters.get(backend)
    adapter.setup(ENV)  # JAX is configured before the Flax model is initialised
    model = torch_net(**kw) if backend == "horovod-torch" else flax_net(**kw)
    return adapter, model


def trainer(adapter, model, steps, **kw):
    return toolkit.Trainer(adapter, model, SGD(lr=0.1, momentum=0.9), global_batch_size=32,
                           max_steps=steps, progress=False, env=ENV, **kw)


NATIVE = ["horovod-torch", "jax-pmap", "jax-pjit"]


@pytest.mark.parametrize("backend", NATIVE)
def test_batchnorm_statistics_are_state_and_change_with_training(backend):
    initial, model = make(backend)
    initial.build(model, SGD(lr=0.1), "cross_entropy")
    before = {k: v for k, v in initial.state_dict().items() if k.startswith("buffers/")}
    adapter, model = make(backend)
    (x, y), val = load_digits()
    t = trainer(adapter, model, 15)
    names = sorted(before)
    assert any("mean" in n for n in names) and any("var" in n for n in names), names
    t.fit(x, y)
    after = adapter.state_dict()
    for name in names:
        if "num_batches_tracked" in name:
            assert int(after[name]) == 15
        else:
            assert not np.array_equal(after[name], before[name]), name
    assert after["rng/step"] == 15
    # Evaluation uses the running statistics (eval mode), so it is a function of the state:
    # loading the state into a fresh model gives the same validation loss exactly.
    fresh, model2 = make(backend)
    fresh.build(model2, SGD(lr=0.1, momentum=0.9), "cross_entropy")
    fresh.load_state_dict(after)
    assert fresh.evaluate(*val) == adapter.evaluate(*val)


@pytest.mark.parametrize("backend", NATIVE)
def test_kill_and_resume_is_bit_for_bit_with_batchnorm_and_dropout(backend, tmp_path):
    (x, y), _ = load_digits()
    straight, model = make(backend)
    trainer(straight, model, 20).fit(x, y)
    first, model = make(backend)
    trainer(first, model, 10, checkpoint_dir=tmp_path, checkpoint_every=10).fit(x, y)
    second, model = make(backend)
    history = trainer(second, model, 20, checkpoint_dir=tmp_path, resume="latest").fit(x, y)
    assert history.first_step == 10
    want, got = straight.state_dict(), second.state_dict()
    assert got.keys() == want.keys()
    assert any(k.startswith("buffers/") for k in got)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_dropout_draws_differ_between_steps_but_not_between_runs():
    """The per-step seed really reaches torch's dropout (else resume equality is vacuous)."""
    (x, y), _ = load_digits()
    batch = (x[:32], y[:32])
    runs = []
    for dropout in (0.5, 0.5, 0.0):
        adapter, model = make("horovod-torch", dropout=dropout)
        adapter.build(model, SGD(lr=0.0), "cross_entropy")
        runs.append([float(adapter.train_step(*batch, None)) for _ in range(3)])
    assert runs[0] == runs[1]
    # Same batch, same weights (lr 0; BatchNorm normalises with the batch's own statistics in
    # training mode): only the dropout masks can make the steps' losses differ.
    assert len(set(runs[0])) == 3
    assert len(set(runs[2])) == 1 and runs[2][0] not in runs[0]


@pytest.mark.parametrize("backend", NATIVE)
def test_a_custom_loss_equals_the_builtin_one_it_reimplements(backend):
    if backend == "horovod-torch":
        import torch

        def loss(out, labels):
            return torch.nn.functional.cross_entropy(out, labels, reduction="none")
    else:
        import jax
        import jax.numpy as jnp

        def loss(out, labels):
            logp = jax.nn.log_softmax(out)
            return -jnp.take_along_axis(logp, labels[:, None], axis=1)[:, 0]
    (x, y), _ = load_digits()
    a, model = make(backend, dropout=0.0)
    builtin = trainer(a, model, 8).fit(x, y).losses
    b, model = make(backend, dropout=0.0)
    custom = trainer(b, model, 8, loss=loss).fit(x, y).losses
    np.testing.assert_allclose(custom, builtin, rtol=1e-6)


@pytest.mark.parametrize("backend", NATIVE)
def test_a_loss_with_the_wrong_shape_is_a_clear_error(backend):
    adapter, model = make(backend, dropout=0.0)
    (x, y), _ = load_digits()
    with pytest.raises(ToolkitError) as err:
        trainer(adapter, model, 2, loss=lambda out, labels: out.mean()).fit(x, y)
    assert re.search(r"returned shape \(\) for a batch of (32|16) samples", str(err.value))
    assert "HINT" in str(err.value)


def test_a_torch_optimizer_over_other_parameters_is_refused():
    import torch

    adapter, model = make("horovod-torch")
    stranger = torch.optim.SGD(torch.nn.Linear(3, 3).parameters(), lr=0.1)
    with pytest.raises(ToolkitError, match="not the model's parameters") as err:
        adapter.build(model, stranger, "cross_entropy")
    assert "model.parameters()" in str(err.value)


@pytest.mark.parametrize("backend", ["jax-pmap", "jax-pjit"])
def test_a_flax_module_without_its_variables_is_refused(backend):
    adapter, (module, _) = make(backend)
    with pytest.raises(ToolkitError, match="without its variables") as err:
        adapter.build(module, SGD(lr=0.1), "cross_entropy")
    assert "module.init" in str(err.value)


def test_exported_torch_state_dict_carries_the_batchnorm_statistics(tmp_path):
    import torch

    from adapters import export

    adapter, model = make("horovod-torch")
    (x, y), _ = load_digits()
    trainer(adapter, model, 6, checkpoint_dir=tmp_path / "ckpt").fit(x, y)
    export.main([str(tmp_path / "ckpt"), "--format", "torch", "--out", str(tmp_path / "m.pt")])
    fresh = torch_net()
    fresh.load_state_dict(torch.load(tmp_path / "m.pt"), strict=True)
    np.testing.assert_array_equal(fresh[1].running_mean.numpy(), model[1].running_mean.numpy())


def results(job):
    return sorted(job.results, key=lambda r: r["rank"])


@pytest.mark.slow
@pytest.mark.parametrize("backend", [*NATIVE, "horovod-tf"])
def test_batchnorm_on_two_ranks_with_and_without_sync(backend, launch):
    """Synchronised BatchNorm on 2 ranks equals one process with the global batch; then, in the
    same processes, without sync each rank normalises with its own samples, and evaluate (its
    sync_state) leaves every rank with rank 0's statistics. (horovod-tf: a Keras model.)"""
    args = (["tests/scripts/batchnorm_worker.py", backend] if backend != "horovod-tf" else
            ["tests/scripts/keras_batchnorm_worker.py"])
    one = launch("python", 1, [*args, "1", "8"])
    two = launch("any", 2, [*args, "1,0", "8"])
    assert one.returncode == 0 and two.returncode == 0, (one, two)
    (single,), rows = results(one), results(two)
    (r0, r1), (u0, u1) = ([r for r in rows if r["sync"] is sync] for sync in (True, False))
    np.testing.assert_allclose(r0["losses"], single["losses"], rtol=1e-5)
    assert r0["losses"] == r1["losses"]
    for name, value in single["buffers"].items():
        assert r0["buffers"][name] == pytest.approx(value, rel=1e-5), name
    assert r0["val"]["val_loss"] == pytest.approx(single["val"]["val_loss"], rel=1e-5)
    if backend != "jax-pjit":  # pjit's step sees the global batch: its statistics always span it
        assert u0["losses"] != r0["losses"]  # local statistics: another run
    assert u0["buffers"] == u1["buffers"]
    assert u0["val"] == u1["val"]


@pytest.mark.parametrize("backend", [*NATIVE, "horovod-tf"])
def test_custom_metrics_are_averaged_like_the_loss(backend):
    """A metric re-implementing the per-sample loss reports exactly val_loss."""
    if backend == "horovod-torch":
        import torch

        def nll(out, labels):
            return torch.nn.functional.cross_entropy(out, labels, reduction="none")
    elif backend == "horovod-tf":
        import tensorflow as tf

        def nll(out, labels):
            return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=out)
    else:
        import jax
        import jax.numpy as jnp

        def nll(out, labels):
            logp = jax.nn.log_softmax(out)
            return -jnp.take_along_axis(logp, labels[:, None], axis=1)[:, 0]
    adapter = adapters.get(backend)
    (x, y), val = load_digits()
    t = toolkit.Trainer(adapter, toolkit.MLP((64, 16, 10)), SGD(lr=0.1), global_batch_size=32,
                        max_steps=5, progress=False, env=ENV, metrics={"nll": nll},
                        eval_batch_size=100)
    t.fit(x, y)
    result = t.evaluate(*val)
    assert result["val_nll"] == pytest.approx(result["val_loss"], rel=1e-6)
    with pytest.raises(ToolkitError, match="metric name 'loss' cannot be used"):
        toolkit.Trainer(adapter, toolkit.MLP((64, 16, 10)), SGD(lr=0.1), global_batch_size=32,
                        metrics={"loss": nll})
    # cross_entropy reports val_accuracy itself; with a loss of one's own, "accuracy" is free.
    with pytest.raises(ToolkitError, match="metric name 'accuracy' cannot be used"):
        toolkit.Trainer(adapter, toolkit.MLP((64, 16, 10)), SGD(lr=0.1), global_batch_size=32,
                        metrics={"accuracy": nll})
    mine = toolkit.Trainer(adapter, toolkit.MLP((64, 16, 10)), SGD(lr=0.1), global_batch_size=32,
                           loss=nll, metrics={"accuracy": nll})
    assert list(mine.metrics) == ["accuracy"]


def test_a_metric_with_the_wrong_shape_is_a_clear_error():
    adapter = adapters.get("horovod-torch")
    (x, y), val = load_digits()
    t = toolkit.Trainer(adapter, toolkit.MLP((64, 16, 10)), SGD(lr=0.1), global_batch_size=32,
                        max_steps=1, progress=False, env=ENV,
                        metrics={"mean": lambda out, labels: out.mean()})
    t.fit(x, y)
    with pytest.raises(ToolkitError, match=r"metric 'mean' returned shape \(\) for a batch"):
        t.evaluate(*val)


def own_optimizer(backend, model, kind="adamw"):
    """The framework's own optimizer: torch.optim over the model's parameters, or an optax
    chain with a schedule (state: Adam's moments and count, the schedule's count)."""
    if backend == "horovod-torch":
        import torch

        if kind == "adam":
            return torch.optim.Adam(model.parameters(), lr=0.01)
        if kind == "sgd":
            return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.05)
        return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.05)
    import optax

    if kind == "sgd":
        return optax.chain(optax.add_decayed_weights(0.05), optax.sgd(0.1, momentum=0.9))
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(optax.exponential_decay(0.01, 5, 0.8), weight_decay=0.05))


def own_trainer(adapter, model, optimizer, steps, **kw):
    return toolkit.Trainer(adapter, model, optimizer, global_batch_size=32, max_steps=steps,
                           progress=False, env=ENV, **kw)


@pytest.mark.parametrize("backend", NATIVE)
def test_kill_and_resume_is_bit_for_bit_with_the_frameworks_own_optimizer(backend, tmp_path):
    """torch.optim / optax state (moments, step counts, schedule counts) is checkpointed."""
    (x, y), _ = load_digits()

    def run(steps, **kw):
        adapter, model = make(backend)
        own_trainer(adapter, model, own_optimizer(backend, model), steps, **kw).fit(x, y)
        return adapter

    straight = run(20)
    run(10, checkpoint_dir=tmp_path, checkpoint_every=10)
    resumed = run(20, checkpoint_dir=tmp_path, resume="latest")
    want, got = straight.state_dict(), resumed.state_dict()
    assert got.keys() == want.keys()
    assert any(k.startswith("opt/") for k in got), sorted(got)
    assert any(k.startswith("buffers/") for k in got), sorted(got)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.parametrize("backend, kind", [("horovod-torch", "adam"), ("horovod-torch", "sgd"),
                                           ("jax-pmap", "sgd"), ("jax-pjit", "sgd")])
def test_the_frameworks_own_optimizer_trains_like_the_spec_it_equals(backend, kind):
    """torch.optim.Adam is toolkit.Adam's arithmetic, and SGD with momentum and L2 weight decay
    is the same in torch, optax and the spec: a native optimizer gets no extra step, decay or
    count before training starts."""
    spec = Adam(lr=0.01) if kind == "adam" else SGD(lr=0.1, momentum=0.9, weight_decay=0.05)
    (x, y), _ = load_digits()
    a, model = make(backend, dropout=0.0)
    want = own_trainer(a, model, spec, 8).fit(x, y).losses
    b, model = make(backend, dropout=0.0)
    got = own_trainer(b, model, own_optimizer(backend, model, kind), 8).fit(x, y).losses
    np.testing.assert_allclose(got, want, rtol=1e-6)
    if kind == "adam":
        assert int(b.state_dict()["opt/count"]) == 8


@pytest.mark.parametrize("backend", ["jax-pmap", "jax-pjit"])
def test_flax_dropout_draws_differ_between_steps_but_not_between_runs(backend):
    """The per-step key really reaches Flax's Dropout (else resume equality is vacuous)."""
    import optax

    (x, y), _ = load_digits()
    batch = (x[:32], y[:32])
    runs = []
    for dropout in (0.5, 0.5, 0.0):
        adapter, model = make(backend, dropout=dropout)
        adapter.build(model, optax.sgd(0.0), "cross_entropy")
        runs.append([float(adapter.train_step(*batch, None)) for _ in range(3)])
    assert runs[0] == runs[1]
    assert len(set(runs[0])) == 3  # same batch, same weights: only the dropout masks differ
    assert len(set(runs[2])) == 1 and runs[2][0] not in runs[0]


@pytest.mark.parametrize("source, target", [("horovod-torch", "jax-pjit"),
                                            ("jax-pmap", "jax-pjit"),
                                            ("jax-pjit", "horovod-torch")])
def test_a_native_model_resumes_into_the_backend_that_wrote_it_only(source, target, tmp_path):
    (x, y), _ = load_digits()
    adapter, model = make(source)
    trainer(adapter, model, 3, checkpoint_dir=tmp_path).fit(x, y)
    adapter, model = make(target)
    with pytest.raises(ToolkitError) as err:
        trainer(adapter, model, 6, checkpoint_dir=tmp_path, resume="latest").fit(x, y)
    assert f"holds a native model written by {source}, but this run uses {target}" in \
        str(err.value)
    assert f"--backend {source}" in str(err.value) and "HINT" in str(err.value)
