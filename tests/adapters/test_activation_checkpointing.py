"""``activation_checkpointing=True``: each GPT block (each hidden MLP layer) keeps only its input
and recomputes its activations in the backward pass, through each framework's own mechanism
(``torch.utils.checkpoint``, ``nn.remat`` / ``jax.checkpoint``, ``tf.recompute_grad``), as a
build option of the spec models. The same losses and parameters as without it; less saved for
the backward pass."""

from __future__ import annotations

import numpy as np
import pytest

import adapters
import toolkit
from toolkit import ToolkitError
from toolkit.equivalence import load_data, make_model

CASES = [("horovod-torch", "data"), ("horovod-torch", "sharded:3"),
         ("horovod-torch", "pipeline:1:4:1f1b"), ("jax-pjit", "pipeline:1:4"), ("jax-pmap", "data"),
         ("jax-pmap", "sharded:1"), ("jax-pjit", "data"), ("jax-pjit", "sharded:3:tp2"),
         ("horovod-tf", "data"), ("horovod-tf", "sharded:2"), ("horovod-tf", "sharded:3"),
         ("horovod-tf", "pipeline:1:4"), ("horovod-torch", "pipeline:1:4+sharded:3"),
         ("horovod-torch", "pipeline:1:4+sharded:3:gather=micro-batch"),
         ("horovod-tf", "pipeline:1:4+sharded:3")]
# bit for bit: the same kernels run again (horovod-torch, ZeRO-3's saved-tensor hooks
# included); horovod-tf's ZeRO-3 recomputes unless told False, when it keeps the forward's tape
# (bit for bit on one process; at 2 ranks grappler's rewrites move a last bit, docs/memory.md)
BIT_FOR_BIT = {("horovod-torch", layout) for _, layout in CASES} | {("horovod-tf", "sharded:3")}


def train(backend, layout, model, recompute, steps=4):
    x, y = load_data(model, "float32")
    adapter = adapters.get(backend)
    # (SGD: Adam would magnify a last-bit difference of a near-zero gradient)
    trainer = toolkit.Trainer(adapter, make_model(model), toolkit.SGD(lr=0.1, momentum=0.9),
                              layout=layout,
                              global_batch_size=8, max_steps=steps, seed=0, progress=False,
                              activation_checkpointing=recompute)
    losses = np.asarray(trainer.fit(x, y).losses)
    params = {k: v for k, v in adapter.state_dict().items() if k.startswith("params/")}
    return losses, params


# (the GPT of jax-pmap and horovod-tf data parallel, and of horovod-tf's pipeline x ZeRO, with
# make test-long: their ZeRO and pipeline GPTs recompute the same blocks in make test, and the
# MLP runs under pipeline x ZeRO)
LONG = {("jax-pmap", "data", "gpt"), ("horovod-tf", "data", "gpt"),
        ("horovod-tf", "pipeline:1:4+sharded:3", "gpt")}


@pytest.mark.parametrize("backend, layout, model", [
    pytest.param(b, layout, m, marks=[pytest.mark.long] if (b, layout, m) in LONG else [])
    for b, layout in CASES for m in ("gpt", "mlp")
    if m == "gpt" or not layout.endswith("tp2")])  # (tensor parallelism splits the GPT only)
def test_recomputing_changes_nothing_it_computes(backend, layout, model):
    plain, plain_params = train(backend, layout, model, False)
    again, again_params = train(backend, layout, model, True)
    if (backend, layout) in BIT_FOR_BIT:
        assert np.array_equal(again, plain)
        assert all(np.array_equal(again_params[k], v) for k, v in plain_params.items())
    # XLA may fuse the recomputed forward differently: the last bit moves (1.1e-7 measured)
    assert np.allclose(again, plain, rtol=1e-6, atol=0), (again, plain)
    for name, value in plain_params.items():
        assert np.allclose(again_params[name], value, rtol=1e-5, atol=1e-7), name


def test_torch_keeps_less_for_the_backward_pass():
    """What the forward pass saves for the backward (every tensor autograd packs), with and
    without recomputation: the blocks' insides are not kept."""
    import torch

    from adapters.horovod_torch.models.spec import build_spec_model, saved_bytes

    spec = toolkit.GPT(vocab=64, context=32, width=32, layers=4, heads=4)
    x = torch.randint(0, 64, (4, 32))
    saved = {r: saved_bytes(torch, lambda r=r: build_spec_model(torch, spec, r)[0](x).sum())
             for r in (False, True)}
    assert saved[True] < saved[False] / 2, saved


def test_a_torch_pipeline_stage_keeps_less_for_the_backward_pass():
    """A stage of the horovod-torch pipeline (its blocks cut from the GPT) with and without
    recomputation: the pieces' blocks really run under the checkpoint."""
    import torch

    from adapters.horovod_torch.models.spec import saved_bytes
    from adapters.horovod_torch.stages import cut_model

    spec = toolkit.GPT(vocab=64, context=32, width=32, layers=4, heads=4)
    x = torch.randint(0, 64, (4, 32))
    layout = toolkit.parse_layout("pipeline:2:2")

    def saved(recompute):
        (piece,) = cut_model(torch, spec, layout, 0, torch.float32, None, recompute).pieces
        for _, p, _, _ in piece.params:
            p.data.normal_()  # (built uninitialised)
        return saved_bytes(torch, lambda: piece.forward(x).sum())

    plain, again = saved(False), saved(True)
    assert 0 < again < plain / 2, (again, plain)


def test_a_tf_pipeline_stage_recomputes_its_blocks(monkeypatch):
    """A stage of the horovod-tf pipeline (its blocks cut from the GPT), run eagerly forward and
    backward with and without recomputation: each block runs again in the backward pass
    (``tf.recompute_grad``), and the gradients are the same."""
    import tensorflow as tf

    from adapters.horovod_tf.models import gpt
    from adapters.horovod_tf.stages import cut_model

    spec = toolkit.GPT(vocab=64, context=32, width=32, layers=4, heads=4)
    x = tf.constant(np.random.default_rng(0).integers(0, 64, (4, 32)))
    runtime = type("Runtime", (), {"dtype_name": "float32"})()
    calls, block = [], gpt._block
    monkeypatch.setattr(gpt, "_block", lambda *a: calls.append(a[3]) or block(*a))

    def run(recompute):
        cut = cut_model(tf, spec, toolkit.parse_layout("pipeline:2:2"), 0, runtime, 0, recompute)
        (piece,) = cut.pieces
        calls.clear()
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(piece.forward(x, True)))
        grads = tape.gradient(loss, list(cut.variables.values()))
        return list(calls), [np.asarray(g) for g in grads]

    (plain, plain_grads), (again, again_grads) = run(False), run(True)
    assert plain == ["blocks.0", "blocks.1"], plain  # stage 0 of 2 holds two blocks
    assert sorted(again) == sorted(plain * 2), again  # each run again in the backward
    assert all(np.array_equal(a, b) for a, b in zip(again_grads, plain_grads, strict=True))


def test_tf_zero3_runs_each_unit_again_unless_told_not_to():
    """horovod-tf's ZeRO-3 by default and with the option runs each unit's forward again in its
    backward (after gathering its parameters again); with ``activation_checkpointing=False``
    its backward takes the forward's tape: each unit runs once, eagerly and in the compiled
    step, and the gradients and losses are the same."""
    import tensorflow as tf

    x, y = load_data("gpt", "float32")

    def run(recompute):
        adapter = adapters.get("horovod-tf")
        trainer = toolkit.Trainer(adapter, make_model("gpt"), toolkit.SGD(lr=0.1),
                                  layout="sharded:3", global_batch_size=8, max_steps=0, seed=0,
                                  progress=False, activation_checkpointing=recompute)
        trainer.fit(x, y)
        shards, calls = adapter.strategy.shards, []
        shards.unit_fns = [(lambda v, h, x, i=i, fn=fn: calls.append(i) or fn(v, h, x), needs)
                           for i, (fn, needs) in enumerate(shards.unit_fns)]
        with tf.GradientTape() as tape:  # eagerly
            loss = tf.reduce_sum(tf.square(shards.forward(x[:8])))
        grads = tape.gradient(loss, [shards.params[u] for u in shards.units])
        eager = list(calls)
        calls.clear()
        trainer.max_steps = 3  # the compiled step, traced once
        losses = np.asarray(trainer.fit(x, y).losses)
        return eager, list(calls), [np.asarray(g) for g in grads], losses

    runs = {recompute: run(recompute) for recompute in (None, True, False)}
    units = list(range(make_model("gpt").layers))  # a GPT's units: its blocks
    for eager, traced, _, _ in (runs[None], runs[True]):  # the backward in reverse order
        assert eager == traced == units + units[::-1], (eager, traced)
    eager, traced, kept, losses = runs[False]
    assert eager == traced == units, (eager, traced)
    for _, _, grads, again in (runs[None], runs[True]):
        assert all(np.array_equal(a, b) for a, b in zip(grads, kept, strict=True))
        assert np.array_equal(again, losses), (again, losses)


def test_jax_pmap_zero3_recomputes_its_products_only_when_asked():
    """jax-pmap's ZeRO-3 gathers each unit again in the backward either way; without the option
    it keeps the unit's matrix products (fewer in the step program, as lowered), with it it
    computes them again. The same losses. (The MLP: 5 products against 6; the test GPT's are
    39 against 50.)"""
    import jax

    def run(recompute):
        x, y = load_data("mlp", "float32")
        adapter = adapters.get("jax-pmap")
        trainer = toolkit.Trainer(adapter, make_model("mlp"), toolkit.SGD(lr=0.1, momentum=0.9),
                                  layout="sharded:3", global_batch_size=8, max_steps=0, seed=0,
                                  progress=False, activation_checkpointing=recompute)
        trainer.fit(x, y)
        strategy, program = adapter.strategy, []
        step = strategy._run_step

        def spy(fn, args, **kw):
            if not program:
                program.append(fn.lower(*jax.tree_util.tree_map(
                    lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)).as_text())
            return step(fn, args, **kw)

        strategy._run_step = spy
        trainer.max_steps = 3
        losses = np.asarray(trainer.fit(x, y).losses)
        return program[0].count("dot_general"), losses

    (kept, plain), (again, recomputed) = run(False), run(True)
    assert 0 < kept < again, (kept, again)
    assert np.allclose(plain, recomputed, rtol=1e-6, atol=0), (plain, recomputed)


def native_model(backend):
    if backend == "horovod-torch":
        import torch

        return torch.nn.Sequential(torch.nn.Linear(64, 10))
    import keras

    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])


@pytest.mark.parametrize("backend, layout, recompute_hint", [
    ("horovod-torch", "data", "torch.utils.checkpoint"),
    ("horovod-tf", "pipeline:1:2", "tf.recompute_grad")])
def test_a_native_model_is_told_to_recompute_itself(backend, layout, recompute_hint):
    x, y = load_data("mlp", "float32")
    trainer = toolkit.Trainer(adapters.get(backend), native_model(backend), toolkit.SGD(lr=0.1),
                              layout=layout, global_batch_size=8, max_steps=1, progress=False,
                              activation_checkpointing=True)
    with pytest.raises(ToolkitError, match=f"{backend}: activation_checkpointing applies to the "
                       "toolkit's spec models; this model is a Sequential") as err:
        trainer.fit(x, y)
    assert recompute_hint in err.value.hint and "toolkit.GPT/MLP/CNN" in err.value.hint
