"""bf16-mixed against a numpy reference of the same arithmetic (``toolkit.models.reference`` with
``compute="bfloat16"``: inputs, parameters and every layer's output rounded to bfloat16 where
docs/precision.md's contract says, the loss in full precision, float32 master parameters and
optimizer).

The first steps equal the rounded reference within 1e-6 (a float32 run is 1e-5 away and fails
that bound); over 50 steps the runs drift apart only as rounding boundaries move (a float32
update that differs in its last bit flips a bfloat16 rounding later), which the looser bound
measures. In this process: world size 1 for horovod-torch, the two CPU devices of
tests/conftest.py for jax-pmap (the reference then splits each batch in two, as the devices do).
"""

from __future__ import annotations

import numpy as np
import pytest

import adapters
import toolkit
from toolkit import ToolkitError
from toolkit.datasets import load_digits
from toolkit.models.reference import reference_run

STEPS, EARLY, BATCH = 50, 10, 64
EARLY_BOUND = 1e-6  # relative, each of the first EARLY steps
LATE_BOUND = 3e-3  # relative, any of the STEPS steps (measured: docs/precision.md)
CASES = [("horovod-torch", "data", (1, 1)), ("horovod-torch", "sharded:1", (1, 1)),
         ("horovod-torch", "sharded:3", (1, 1)), ("jax-pmap", "data", (1, 2)),
         ("jax-pmap", "sharded:1", (1, 2)), ("jax-pmap", "sharded:2", (1, 2))]
MODEL = toolkit.MLP((64, 128, 10))


def optimizer():
    return toolkit.SGD(lr=0.05, momentum=0.9)


def data():
    return load_digits(seed=0, dtype="float32")[0]


def run(backend, layout, precision, steps=STEPS):
    x, y = data()
    trainer = toolkit.Trainer(adapters.get(backend, precision=precision), MODEL, optimizer(),
                              layout=layout, global_batch_size=BATCH, max_steps=steps, seed=0,
                              progress=False)
    return np.asarray(trainer.fit(x, y).losses)


def rounded_reference(split, steps=STEPS):
    x, y = data()
    losses, _ = reference_run(MODEL, optimizer(), "cross_entropy", x, y, global_batch_size=BATCH,
                              steps=steps, seed=0, dtype="float32", compute="bfloat16",
                              split=split)
    return np.asarray(losses)


def deviation(a, b):
    return np.abs(a - b) / np.abs(b)


@pytest.mark.parametrize("backend, layout, split", CASES)
def test_bf16_mixed_is_the_rounded_arithmetic_and_float32_is_not(backend, layout, split):
    ref = rounded_reference(split)
    mixed = run(backend, layout, "bf16-mixed")
    assert deviation(mixed[:EARLY], ref[:EARLY]).max() <= EARLY_BOUND, deviation(mixed, ref)
    assert deviation(mixed, ref).max() <= LATE_BOUND, deviation(mixed, ref)
    # a run that silently computed in float32 fails the bound (here: the float32 run itself)
    plain = run(backend, layout, "32", steps=EARLY)
    assert deviation(plain, ref[:EARLY]).max() > 10 * EARLY_BOUND, deviation(plain, ref)
    # and bfloat16 trains as float32 does
    assert abs(mixed[-1] - run(backend, layout, "32")[-1]) <= 0.01 * abs(mixed[-1])


def test_the_reference_rounds_only_under_mixed_precision():
    x, y = data()
    params = MODEL.init(0, "float32")
    first = next(iter(toolkit.GlobalBatchSampler(len(x), BATCH, seed=0)))  # the runs' first
    exact = MODEL.loss_and_grads(params, x[first], y[first])
    rounded = MODEL.loss_and_grads(params, x[first], y[first], compute="bfloat16")
    assert exact[0] != rounded[0] and abs(exact[0] - rounded[0]) < 1e-2 * exact[0]
    assert all(g.dtype == np.float32 for g in rounded[1].values())
    # one shard is the batch itself
    one, _ = reference_run(MODEL, optimizer(), "cross_entropy", x, y, global_batch_size=BATCH,
                           steps=2, seed=0, dtype="float32", compute="bfloat16")
    assert one[0] == pytest.approx(rounded[0], rel=1e-12)


@pytest.mark.parametrize("backend, layout", [("jax-pjit", "data"), ("jax-pmap", "sharded:3"),
                                             ("horovod-torch", "pipeline:1:2")])
def test_a_strategy_without_bf16_says_so_before_building(backend, layout):
    x, y = data()
    trainer = toolkit.Trainer(adapters.get(backend, precision="bf16-mixed"), MODEL, optimizer(),
                              layout=layout, global_batch_size=BATCH, max_steps=1,
                              progress=False)
    with pytest.raises(ToolkitError, match="does not run precision 'bf16-mixed'") as err:
        trainer.fit(x, y)
    assert "this strategy runs: 32, 64" in err.value.hint


@pytest.mark.parametrize("backend, layout", [
    ("horovod-torch", "data"), ("horovod-torch", "sharded:3"), ("jax-pmap", "data"),
    ("jax-pmap", "sharded:2")])
def test_a_gpt_trains_in_bf16_mixed_as_in_float32(backend, layout):
    """The GPT (layer norms and softmax in float32, the rest in bfloat16) follows the float32
    run's losses within a percent over its first steps, and holds float32 parameters."""
    from toolkit.equivalence import load_data, make_model

    x, y = load_data("gpt", "float32")
    losses = {}
    for precision in ("32", "bf16-mixed"):
        adapter = adapters.get(backend, precision=precision)
        trainer = toolkit.Trainer(adapter, make_model("gpt"), toolkit.Adam(lr=3e-3),
                                  layout=layout, global_batch_size=8, max_steps=6, seed=0,
                                  progress=False)
        losses[precision] = np.asarray(trainer.fit(x, y).losses)
        assert all(v.dtype == np.float32 for k, v in adapter.state_dict().items()
                   if k.startswith("params/"))
    assert deviation(losses["bf16-mixed"], losses["32"]).max() < 1e-2, losses
    assert deviation(losses["bf16-mixed"], losses["32"]).max() > 1e-6, losses  # it rounded
