"""``on_nonfinite="skip"`` in every backend, in this process: a step whose batch holds a NaN
updates nothing (parameters, optimizer slots and count, BatchNorm statistics), the History
names it, and the next step trains on. Data parallel and ZeRO-3 in all four backends, the JAX
pipelines over two local devices, and tensor parallelism; the multi-rank layouts run in
tests/test_divergence.py."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import adapters
import toolkit
from toolkit.datasets import load_digits

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "scripts"))
from pipeline_jax_worker import attach  # noqa: E402

BATCH, NAN_AT = 32, 3


def poisoned_digits():
    (x, y), _ = load_digits()
    x = np.array(x, np.float32)
    batches = toolkit.GlobalBatchSampler(len(x), BATCH, world_size=1, rank=0, shuffle=True,
                                         seed=0)
    x[next(idx for k, idx in enumerate(batches, 1) if k == NAN_AT)[0]] = np.nan
    return x, y


def trainer_for(backend, layout, model, optimizer):
    adapter = adapters.get(backend)
    if layout.startswith("pipeline") and backend.startswith("jax"):  # two stages over this
        # process's two devices
        adapter.setup(toolkit.current_env())
        attach(adapter, toolkit.parse_layout(layout), samples="process")
        layout = None
    return adapter, toolkit.Trainer(adapter, model, optimizer, layout=layout,
                                    global_batch_size=BATCH, max_steps=NAN_AT - 1,
                                    progress=False, on_nonfinite="skip")


@pytest.mark.parametrize("backend, layout, model", [
    *[(b, layout, toolkit.MLP((64, 16, 10))) for b in adapters.BACKENDS
      for layout in ("data", "sharded:3")],
    ("jax-pmap", "pipeline:2:4:1f1b", toolkit.MLP((64, 16, 16, 10))),
    ("jax-pjit", "pipeline:2:4:gpipe", toolkit.MLP((64, 16, 16, 10))),
    *[(b, "pipeline:1:2+sharded:3", toolkit.MLP((64, 16, 10)))
      for b in ("horovod-torch", "horovod-tf")],
])
def test_a_nan_step_updates_nothing_and_the_next_one_trains(backend, layout, model):
    x, y = poisoned_digits()
    adapter, trainer = trainer_for(backend, layout, model, toolkit.Adam(lr=1e-2))
    trainer.fit(x, y)
    before = adapter.state_dict()
    trainer.max_steps = NAN_AT
    history = trainer.fit(x, y)
    assert history.skipped_steps == [NAN_AT] and np.isnan(history.grad_norms[-1])
    at = adapter.state_dict()
    assert before.keys() == at.keys() and len(at) > 4
    for name in before:
        assert np.array_equal(before[name], at[name]), name
    assert int(at["opt/count"]) == NAN_AT - 1
    trainer.max_steps = NAN_AT + 1
    history = trainer.fit(x, y)
    after = adapter.state_dict()
    assert history.skipped_steps == [] and np.isfinite(history.grad_norms[-1])
    assert int(after["opt/count"]) == NAN_AT
    assert not np.array_equal(after["params/layers.0.kernel"], at["params/layers.0.kernel"])
    assert all(np.isfinite(v).all() for v in after.values() if v.dtype.kind == "f")


def test_on_nonfinite_must_be_stop_or_skip():
    with pytest.raises(toolkit.ToolkitError) as err:
        toolkit.Trainer(adapters.get("jax-pjit"), toolkit.MLP((4, 2)), toolkit.SGD(lr=0.1),
                        global_batch_size=4, on_nonfinite="ignore")
    assert str(err.value) == "unknown on_nonfinite 'ignore'\nHINT: use one of: stop, skip"


def native_model(backend):
    """A small model with BatchNorm and the framework's own AdamW with a schedule."""
    if backend == "horovod-torch":
        import torch

        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.BatchNorm1d(16),
                                  torch.nn.ReLU(), torch.nn.Linear(16, 10))
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        return net, (opt, torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5))
    if backend == "horovod-tf":
        import keras

        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16),
                                  keras.layers.BatchNormalization(), keras.layers.ReLU(),
                                  keras.layers.Dense(10)])
        return model, keras.optimizers.AdamW(
            keras.optimizers.schedules.ExponentialDecay(1e-2, 1, 0.5))
    import flax.linen as nn
    import jax
    import optax

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(nn.Dense(16)(x))
            return nn.Dense(10)(nn.relu(x))

    module = Net()
    variables = module.init(jax.random.PRNGKey(0), np.zeros((1, 64), np.float32))
    return (module, variables), optax.adamw(optax.exponential_decay(1e-2, 1, 0.5))


@pytest.mark.parametrize("backend, layout", [
    *[(b, "data") for b in adapters.BACKENDS], ("horovod-torch", "sharded:3"),
    ("horovod-torch", "pipeline:1:2"), ("horovod-torch", "pipeline:1:2+sharded:2"),
    ("horovod-tf", "pipeline:1:2"), ("jax-pjit", "sharded:2")])
def test_native_models_and_optimizers_skip_with_their_batchnorm_statistics(backend, layout):
    """The framework's own optimizer and schedule under every layout that takes it: a skipped
    step moves neither (its step count, the schedule's position)."""
    x, y = poisoned_digits()
    model, optimizer = native_model(backend)
    adapter, trainer = trainer_for(backend, layout, model, optimizer)
    trainer.fit(x, y)
    before = adapter.state_dict()
    assert any(name.startswith("buffers/") for name in before), sorted(before)
    trainer.max_steps = NAN_AT
    assert trainer.fit(x, y).skipped_steps == [NAN_AT]
    at = adapter.state_dict()
    for name in before:
        if name != "rng/step":  # (the randomness of the next step moves on)
            assert np.array_equal(before[name], at[name]), name
    trainer.max_steps = NAN_AT + 1
    trainer.fit(x, y)
    after = adapter.state_dict()
    moved = [n for n in after if n.startswith(("params/", "opt/", "buffers/"))
             and not np.array_equal(after[n], at[n])]
    assert any(n.startswith("buffers/") for n in moved) and any(n.startswith("opt/")
                                                                 for n in moved), moved
    assert all(np.isfinite(v).all() for v in after.values() if v.dtype.kind == "f")


def deferring_model(backend, optimizer):
    """A spec MLP and ``optimizer``, or (None) a torch model with BatchNorm and torch's fused
    Adam (its step takes the skip as a device flag)."""
    if backend == "horovod-torch" and optimizer is None:
        import torch

        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.BatchNorm1d(16),
                                  torch.nn.ReLU(), torch.nn.Linear(16, 10))
        return net, torch.optim.Adam(net.parameters(), lr=1e-2, fused=True)
    return toolkit.MLP((64, 16, 10)), optimizer


@pytest.mark.parametrize("precision", [None, "fp16-mixed"])
@pytest.mark.parametrize("backend, layout, optimizer", [
    ("horovod-torch", "data", None), ("horovod-torch", "sharded:3", toolkit.Adam(lr=1e-2)),
    ("horovod-torch", "sharded:1", toolkit.SGD(lr=0.1, momentum=0.9)),
    ("horovod-tf", "data", toolkit.SGD(lr=0.1, momentum=0.9)),
    ("horovod-tf", "sharded:2", toolkit.Adam(lr=1e-2)),
    ("jax-pmap", "sharded:2", toolkit.SGD(lr=0.1, momentum=0.9)),
    ("jax-pjit", "data", toolkit.Adam(lr=1e-2))])
def test_a_skip_kept_on_the_device_equals_a_skip_read_on_the_host(backend, layout, optimizer,
                                                                 precision, monkeypatch):
    """The strategies whose step advances the update's counters itself (``defers``) against
    the same step with the skip read on the host after each step: the same losses, norms,
    skips, loss scales and overflows, and the same state bit for bit, over several skips
    (three steps of a poisoned batch; under fp16 inputs large enough to overflow, with a scale
    that grows back every second step)."""
    from adapters._backend import load

    (x, y), _ = load_digits()
    x = np.array(x, np.float32)
    batches = list(toolkit.GlobalBatchSampler(len(x), BATCH, world_size=1, rank=0,
                                              shuffle=True, seed=0))
    options = {}
    if precision is None:
        for k in (2, 3, 6):
            x[batches[k - 1][0]] = np.nan
    else:
        x *= 30
        options = {"precision": precision, "growth_interval": 2}
    strategy = load(adapters.get(backend).strategies[toolkit.parse_layout(layout).kind])
    runs = []
    for defers in (True, False):
        monkeypatch.setattr(strategy, "defers", defers)
        model, opt = deferring_model(backend, optimizer)
        adapter = adapters.get(backend, precision=options.get("precision"))
        trainer = toolkit.Trainer(adapter, model, opt, layout=layout, global_batch_size=BATCH,
                                  max_steps=10, progress=False, on_nonfinite="skip",
                                  clip_grad_norm=1.0, **{k: v for k, v in options.items()
                                                         if k != "precision"})
        history = trainer.fit(x, y)
        assert adapter.strategy.rule.deferred == defers
        runs.append((history, adapter.state_dict()))
    (device, device_state), (host, host_state) = runs
    for field in ("losses", "grad_norms", "skipped_steps", "loss_scales", "overflow_steps"):
        assert np.array_equal(getattr(device, field), getattr(host, field), equal_nan=True), field
    assert (device.skipped_steps if precision is None else device.overflow_steps), "no skip"
    assert device_state.keys() == host_state.keys()
    for name, value in host_state.items():
        assert np.asarray(value).tobytes() == np.asarray(device_state[name]).tobytes(), name
