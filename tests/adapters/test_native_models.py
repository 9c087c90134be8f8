"""Native models through the same Trainer, and the bad input each backend must refuse."""

import json

import numpy as np
import pytest

import adapters
import toolkit
from toolkit import MLP, SGD, LaunchEnv, ToolkitError
from toolkit.datasets import load_digits

ENV = LaunchEnv()


def train(adapter, model, steps=30):
    (x, y), val = load_digits()
    trainer = toolkit.Trainer(adapter, model, SGD(lr=0.1, momentum=0.9), global_batch_size=32,
                              max_steps=steps, progress=False, env=ENV)
    history = trainer.fit(x, y)
    return history, trainer


def spec_losses(backend):
    history, _ = train(adapters.get(backend), MLP((64, 32, 10)))
    return history.losses


def test_torch_module_trains_like_the_spec():
    import torch

    spec = MLP((64, 32, 10))
    params = spec.init(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    with torch.no_grad():
        for i, layer in enumerate((net[0], net[2])):
            layer.weight.copy_(torch.from_numpy(params[f"layers.{i}.kernel"].T.copy()))
            layer.bias.copy_(torch.from_numpy(params[f"layers.{i}.bias"]))
    history, trainer = train(adapters.get("horovod-torch"), net)
    np.testing.assert_allclose(history.losses, spec_losses("horovod-torch"), rtol=1e-6)
    assert "params/0.weight" in trainer.adapter.state_dict()


def test_keras_dense_model_trains_like_the_spec():
    """A Keras model is a native model (no mapping onto MLP), but of Dense layers it is the
    spec's function, so with the spec's weights it trains like the spec."""
    import keras

    spec = MLP((64, 32, 10))
    params = spec.init(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(10)])
    for i, layer in enumerate(model.layers):
        layer.set_weights([params[f"layers.{i}.kernel"], params[f"layers.{i}.bias"]])
    history, trainer = train(adapters.get("horovod-tf"), model)
    np.testing.assert_allclose(history.losses, spec_losses("horovod-tf"), rtol=1e-6)
    assert "params/sequential/dense/kernel" in trainer.adapter.state_dict()


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_a_keras_mixed_precision_policy_is_refused_with_its_reason(policy):
    """A model built under a Keras mixed policy would compute in 16 bits behind the start-up
    block's float32 (and fp16 without loss scaling): refused, naming the policy."""
    import keras

    keras.mixed_precision.set_global_policy(policy)
    try:
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    (x, y), _ = load_digits()
    trainer = toolkit.Trainer(adapters.get("horovod-tf"), model, SGD(lr=0.1),
                              global_batch_size=32, max_steps=1, progress=False, env=ENV)
    with pytest.raises(ToolkitError) as err:
        trainer.fit(x, y)
    assert f"built under the mixed precision policy '{policy}'" in str(err.value)
    assert "set_global_policy('float32')" in str(err.value)


def test_a_keras_loss_scale_optimizer_is_refused_under_data_parallel():
    import keras

    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    (x, y), _ = load_digits()
    trainer = toolkit.Trainer(adapters.get("horovod-tf"), model, opt, global_batch_size=32,
                              max_steps=1, progress=False, env=ENV)
    with pytest.raises(ToolkitError, match="cannot use .*LossScaleOptimizer.* scales the loss"):
        trainer.fit(x, y)


def test_keras_model_with_conv_batchnorm_and_dropout_trains():
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((8, 8, 1)), keras.layers.Conv2D(8, 3, padding="same", activation="relu"),
        keras.layers.BatchNormalization(), keras.layers.Dropout(0.3), keras.layers.Flatten(),
        keras.layers.Dense(10)])
    (x, y), _ = load_digits()
    trainer = toolkit.Trainer(adapters.get("horovod-tf"), model, SGD(lr=0.05, momentum=0.9),
                              global_batch_size=32, max_steps=30, progress=False, env=ENV)
    history = trainer.fit(x.reshape(-1, 8, 8, 1), y)
    assert np.mean(history.losses[-5:]) < 0.5 * np.mean(history.losses[:5])
    assert any(k.startswith("buffers/") for k in trainer.adapter.state_dict())


@pytest.mark.parametrize("backend", ["jax-pmap", "jax-pjit"])
def test_flax_module_trains_like_the_spec(backend):
    import flax.linen as nn
    import jax

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(10, name="out")(nn.relu(nn.Dense(32, name="hidden")(x)))

    spec_params = MLP((64, 32, 10)).init(0)
    variables = {"params": {
        "hidden": {"kernel": spec_params["layers.0.kernel"], "bias": spec_params["layers.0.bias"]},
        "out": {"kernel": spec_params["layers.1.kernel"], "bias": spec_params["layers.1.bias"]}}}
    history, trainer = train(adapters.get(backend), (Net(), variables))
    np.testing.assert_allclose(history.losses, spec_losses(backend), rtol=1e-5)
    assert "params/hidden.kernel" in trainer.adapter.state_dict()
    assert jax.local_device_count() == 2  # conftest: both devices really took part


@pytest.mark.parametrize("backend", ["jax-pmap", "jax-pjit"])
def test_a_flax_nnx_module_trains_like_the_spec(backend):
    """An NNX module (Flax's recommended API) as it is: its own variables as the parameters,
    trained as the spec with the same weights; in a (module, variables) pair it is refused
    naming what to pass."""
    import jax.numpy as jnp
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.hidden, self.out = nnx.Linear(64, 32, rngs=rngs), nnx.Linear(32, 10, rngs=rngs)

        def __call__(self, x):
            return self.out(nnx.relu(self.hidden(x)))

    def net():
        made, spec_params = Net(nnx.Rngs(0)), MLP((64, 32, 10)).init(0)
        for layer, i in ((made.hidden, 0), (made.out, 1)):
            layer.kernel[...] = jnp.asarray(spec_params[f"layers.{i}.kernel"])
            layer.bias[...] = jnp.asarray(spec_params[f"layers.{i}.bias"])
        return made

    history, trainer = train(adapters.get(backend), net())
    np.testing.assert_allclose(history.losses, spec_losses(backend), rtol=1e-5)
    assert {"params/hidden.kernel", "params/out.bias"} <= set(trainer.adapter.state_dict())
    (x, y), _ = load_digits()
    sharded = toolkit.Trainer(adapters.get(backend), net(), SGD(lr=0.1, momentum=0.9),
                              layout="sharded:3" if backend == "jax-pjit" else "sharded:2",
                              global_batch_size=32, max_steps=30, progress=False, env=ENV)
    np.testing.assert_allclose(sharded.fit(x, y).losses, history.losses, rtol=1e-5)
    trainer = toolkit.Trainer(adapters.get(backend), (Net(nnx.Rngs(0)), None), SGD(lr=0.1),
                              global_batch_size=64, max_steps=1, progress=False, env=ENV)
    with pytest.raises(ToolkitError, match="got the Flax NNX module Net in a pair"):
        trainer.fit(x, y)


@pytest.mark.parametrize("backend", [  # (jax-pmap with make test-long: the same NnxModule)
    pytest.param("jax-pmap", marks=pytest.mark.long), "jax-pjit"])
def test_an_nnx_module_with_dropout_and_batchnorm_keeps_its_state_and_draws_per_step(
        backend, tmp_path):
    """Dropout and BatchNorm the NNX way: training switches them on (masks from the step's key:
    two runs alike, two steps not), evaluation off (deterministic, running statistics);
    BatchNorm's statistics are model state, checkpointed and resumed bit for bit."""
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.hidden = nnx.Linear(64, 32, rngs=rngs)
            self.norm = nnx.BatchNorm(32, rngs=rngs)
            self.drop = nnx.Dropout(0.3, rngs=rngs)
            self.layers = nnx.List([nnx.Linear(32, 10, rngs=rngs)])

        def __call__(self, x):
            return self.layers[0](self.drop(self.norm(nnx.relu(self.hidden(x)))))

    (x, y), (vx, vy) = load_digits()
    import jax

    from adapters._jax.models.nnx import NnxModule

    module = NnxModule(Net(nnx.Rngs(0)))
    variables = module.variables()

    def trained(seed):
        out, state = module.apply(variables, x[:8], train=True, mutable=["state"],
                                  rngs={"dropout": jax.random.key(seed)})
        return np.asarray(out), state

    (one, moved), (two, _), (same, _) = trained(1), trained(2), trained(1)
    assert np.array_equal(one, same) and not np.array_equal(one, two)  # masks by the key
    assert not np.array_equal(np.asarray(moved["state"]["norm"]["mean"]),
                              np.asarray(variables["state"]["norm"]["mean"]))
    evaluated = np.asarray(module.apply(variables, x[:8]))
    assert np.array_equal(evaluated, np.asarray(module.apply(variables, x[:8])))

    def run(steps, ckpt, resume=None):
        t = toolkit.Trainer(adapters.get(backend), Net(nnx.Rngs(0)), SGD(lr=0.1),
                            global_batch_size=32, max_steps=steps, progress=False, env=ENV,
                            checkpoint_dir=ckpt, checkpoint_every=3, resume=resume)
        history = t.fit(x, y)
        return t, history

    whole, history = run(6, tmp_path / "a")
    again, again_history = run(6, tmp_path / "b")
    assert history.losses == again_history.losses  # the same masks, run after run
    state = whole.adapter.state_dict()
    assert {"buffers/state/norm.mean", "buffers/state/norm.var", "params/layers.0.kernel"} \
        <= set(state)
    assert np.any(state["buffers/state/norm.mean"] != 0)  # statistics moved while training
    first = whole.evaluate(vx, vy, log=False)
    assert whole.evaluate(vx, vy, log=False) == first  # evaluation: no dropout
    run(3, tmp_path / "c")
    resumed, _ = run(6, tmp_path / "c", resume="latest")
    b = resumed.adapter.state_dict()
    for k in state:
        assert np.array_equal(state[k], b[k]), k


@pytest.mark.parametrize("backend", ["jax-pmap", "jax-pjit"])
def test_jax_device_count_that_does_not_divide_the_batch(backend):
    adapter = adapters.get(backend)
    adapter.setup(ENV)
    adapter.build(MLP((4, 3)), SGD(lr=0.1), "cross_entropy")
    with pytest.raises(ToolkitError) as err:
        adapter.train_step(np.zeros((3, 4), np.float32), np.zeros(3, np.int64), 0.1)
    assert "local batch of 3 samples does not split over 2 local devices" in str(err.value)


def test_dtype_a_backend_cannot_run():
    with pytest.raises(ToolkitError, match="unknown dtype 'bfloat16'") as err:
        adapters.get("jax-pjit", dtype="bfloat16")
    assert "float32, float64" in str(err.value) and "precision='bf16-mixed'" in str(err.value)


def _torch_net_and_schedule(kind):
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10))
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    lr_scheduler = torch.optim.lr_scheduler
    if kind == "step":
        sched = lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    else:  # nested schedulers, a lambda and int milestones
        sched = lr_scheduler.SequentialLR(opt, [
            lr_scheduler.LambdaLR(opt, lambda step: (step + 1) / 3),
            lr_scheduler.CosineAnnealingLR(opt, T_max=4)], milestones=[3])
    return net, opt, sched


@pytest.mark.parametrize("kind", ["step", "sequential"])
def test_a_torch_lr_scheduler_is_stepped_checkpointed_and_resumed_bit_for_bit(kind, tmp_path):
    (x, y), _ = load_digits()

    def trainer(steps, ckpt, resume=None, log=None):
        net, opt, sched = _torch_net_and_schedule(kind)
        adapter = adapters.get("horovod-torch")
        t = toolkit.Trainer(adapter, net, (opt, sched), global_batch_size=32, max_steps=steps,
                            checkpoint_dir=ckpt, checkpoint_every=3, resume=resume,
                            progress=False, env=ENV, metrics_log=log, log_every=2)
        t.fit(x, y)
        return t, opt

    whole, opt = trainer(7, tmp_path / "a", log=tmp_path / "m.jsonl")
    lrs = [opt.param_groups[0]["lr"]]
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    logged = {r["step"]: r["lr"] for r in records if r["event"] == "step"}
    assert sorted(logged) == list(range(1, 8)) and all(lr is not None for lr in logged.values())
    assert all("lr" in r for r in records if r["event"] == "interval")
    if kind == "step":  # stepped once per optimizer step: 7 steps, halved every 2
        assert lrs[0] == pytest.approx(0.1 * 0.5 ** 3)
        # the lr each step ran with, as the pair's scheduler set it
        assert [logged[s] for s in range(1, 8)] == pytest.approx(
            [0.1 * 0.5 ** ((s - 1) // 2) for s in range(1, 8)])
    trainer(3, tmp_path / "b")  # stops after step 3 (its checkpoint)...
    resumed, opt_b = trainer(7, tmp_path / "b", resume="latest")  # ...and goes on to 7
    assert opt_b.param_groups[0]["lr"] == lrs[0]
    a, b = whole.adapter.state_dict(), resumed.adapter.state_dict()
    assert a.keys() == b.keys() and any(k.startswith("sched/") for k in a)
    for k in a:
        assert np.array_equal(a[k], b[k]), k


def test_a_scheduler_of_another_optimizer_is_refused():
    import torch

    net, opt, _ = _torch_net_and_schedule("step")
    other = torch.optim.SGD(net.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(other, step_size=2)
    (x, y), _ = load_digits()
    t = toolkit.Trainer(adapters.get("horovod-torch"), net, (opt, sched), global_batch_size=32,
                        max_steps=1, progress=False, env=ENV)
    with pytest.raises(ToolkitError, match="schedules another optimizer"):
        t.fit(x, y)
