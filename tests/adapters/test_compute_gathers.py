"""ZeRO-3 under mixed precision gathers each unit's parameters in the compute dtype (FSDP2's
``param_dtype``) and reduce-scatters gradients in float32 (its ``reduce_dtype``): half the
gather bytes in bfloat16, the same arithmetic. horovod-torch's gathers are read off the real
Horovod calls; jax-pmap's off the program it hands XLA."""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import pytest

import adapters
import toolkit
from toolkit.equivalence import load_data, make_model

ROOT = Path(__file__).resolve().parents[2]


def train(backend, model, layout, precision, steps=3, spy=lambda strategy: None):
    """The run's losses; ``spy`` sees the strategy once it is built (before the first step)."""
    x, y = load_data(model, "float32")
    adapter = adapters.get(backend)
    trainer = toolkit.Trainer(adapter, make_model(model), toolkit.SGD(lr=0.1, momentum=0.9),
                              layout=layout, precision=precision, global_batch_size=16,
                              max_steps=0, seed=0, progress=False)
    trainer.fit(x, y)
    spy(adapter.strategy)
    trainer.max_steps = steps
    return np.asarray(trainer.fit(x, y).losses)


class Gathers:
    """horovod-torch's Horovod, recording each all-gather's name, dtype and bytes."""

    def __init__(self, hvd):
        self.hvd, self.calls = hvd, collections.defaultdict(set)
        self.counts = collections.Counter()

    def __getattr__(self, name):
        return getattr(self.hvd, name)

    def allgather(self, tensor, name=None):
        self.calls[name].add((str(tensor.dtype), tensor.numel() * tensor.element_size()))
        self.counts[name] += 1
        return self.hvd.allgather(tensor, name=name)

    def install(self, strategy):
        strategy.shards._gather.hvd = self


@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_horovod_torch_gathers_16_bits_and_computes_as_before(model):
    gathers = {p: Gathers(__import__("horovod.torch").torch) for p in ("32", "bf16-mixed")}
    losses = {p: train("horovod-torch", model, "sharded:3", p, spy=gathers[p].install)
              for p in gathers}
    f32, bf16 = gathers["32"].calls, gathers["bf16-mixed"].calls
    units = sorted(n for n in f32 if n.startswith("zero.gather."))
    assert units and all(len(f32[n]) == 1 for n in units), f32
    for name in units:
        ((_, float_bytes),) = f32[name]
        assert bf16[name] == {("torch.int16", float_bytes // 2)}, (name, bf16[name])
    # the module computes on views of the 16-bit buffer, so what its operations save for the
    # backward are views too: freed after the forward and gathered again, as in float32 (but
    # the GPT's first unit: its tied tok_emb is read in float32 by the lookup, and the head's
    # product makes autocast's own 16-bit copy of it, kept for the backward)
    again = [n for n in units if model == "mlp" or n != "zero.gather.0"]
    assert {n: gathers["bf16-mixed"].counts[n] for n in again} == {
        n: gathers["32"].counts[n] for n in again}, gathers["bf16-mixed"].counts
    # the parameters the arithmetic uses in float32 (embeddings, layer norms) come in float32
    kept = {n: b for n, calls in bf16.items() if ".float." in n for _, b in calls}
    params = make_model(model).init(0, "float32")
    assert sum(kept.values()) == 4 * sum(
        v.size for k, v in params.items() if not k.endswith(("kernel", "bias"))
        or ".ln" in k or k.startswith("ln_")), kept
    # the same losses as data parallelism's (which never gathers): every value exact
    assert np.array_equal(losses["bf16-mixed"], train("horovod-torch", model, "data",
                                                      "bf16-mixed")), losses


def test_horovod_tf_gathers_16_bits_and_reduces_in_float32():
    """horovod-tf's ZeRO-3 step as TensorFlow traces it: each all-gather's and reduce-scatter's
    operand (a unit's shard in and its gradient out), in float32 and in bf16-mixed."""
    import horovod.tensorflow as hvd

    class Collectives:
        def __init__(self):
            self.calls = []

        def __getattr__(self, name):
            return getattr(hvd, name)

        def allgather(self, tensor, **kw):
            self.calls.append(("allgather", tensor.dtype.name, tensor.shape.num_elements()
                               * tensor.dtype.size))
            return hvd.allgather(tensor, **kw)

        def reducescatter(self, tensor, **kw):  # (its traced shape may be unknown)
            self.calls.append(("reducescatter", tensor.dtype.name, None))
            return hvd.reducescatter(tensor, **kw)

        def install(self, strategy):
            strategy.shards.hvd = self

    seen = {p: Collectives() for p in ("32", "bf16-mixed")}
    losses = {p: train("horovod-tf", "mlp", "sharded:3", p, spy=seen[p].install) for p in seen}
    f32, bf16 = seen["32"].calls, seen["bf16-mixed"].calls
    assert len(f32) == len(bf16) and {c[:2] for c in f32} == {
        ("allgather", "float32"), ("reducescatter", "float32")}, f32
    for (kind, _, size), got in zip(f32, bf16, strict=True):
        assert got == ((kind, "int16", size // 2) if kind == "allgather" else
                       (kind, "float32", None)), (f32, bf16)
    assert np.array_equal(losses["bf16-mixed"], train("horovod-tf", "mlp", "data",
                                                      "bf16-mixed")), losses


@pytest.mark.parametrize("backend", ["jax-pmap", "jax-pjit"])
def test_jax_gathers_16_bits_and_reduces_in_float32(backend, tmp_path):
    """The step program once XLA has placed its collectives (jax-pjit's exist only after its
    partitioner), before the CPU compiler widens 16-bit ones: half the all-gather bytes and the
    same float32 reductions."""
    import jax

    from adapters._jax.hlo import partitioned_collectives

    programs = {}

    def lowered(strategy):
        run = strategy._run_step

        def spy(fn, args, **kw):
            name = strategy.precision.name
            if name not in programs:
                shapes = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(
                    a.shape, a.dtype, sharding=getattr(a, "sharding", None))
                    if hasattr(a, "shape") else a, args)
                programs[name] = partitioned_collectives(fn.lower(*shapes), tmp_path / name)
            return run(fn, args, **kw)

        strategy._run_step = spy

    for precision in ("32", "bf16-mixed"):
        train(backend, "mlp", "sharded:3", precision, steps=1, spy=lowered)
    f32, bf16 = programs["32"], programs["bf16-mixed"]
    assert f32[("all-gather", "f32")] > 0 and ("all-gather", "f32") not in bf16, programs
    assert bf16[("all-gather", "bf16")] * 2 == f32[("all-gather", "f32")], programs
    reductions = {k: v for k, v in f32.items() if k[0] != "all-gather"}
    assert reductions and {k: v for k, v in bf16.items() if k[0] != "all-gather"} == \
        reductions, programs


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["data", "sharded:3:tp2"])
def test_jax_pjit_gpt_reduces_gradients_in_float32_and_splits_in_16_bits(launch, layout):
    """The GPT under jax-pjit on 4 devices (``sharded:3:tp2``: 2 x 2, data x model), its step
    program as XLA partitions it. Under bf16-mixed every gradient reduction carries what the
    float32 run's does, in float32: the embeddings' and the tied head's gradients are summed in
    float32 (``models/gpt.py``: ``embed``, ``tied_logits``), and the split kernels' through
    their custom gradient (``tensor_parallel.products``). Tensor parallelism's own all-reduces
    (two per block forward, two backward, each of the local batch's activations) carry
    bfloat16, as Megatron's: half their float32 bytes. ZeRO-3 gathers every buffer in 16 bits."""
    import json

    job = launch("python", 1, [str(ROOT / "tests" / "scripts" / "jax_collectives_worker.py"),
                               "--devices", "4", "--layout", layout])
    assert job.returncode == 0, job
    got = json.loads(job.stdout.strip().splitlines()[-1])
    f32, bf16 = got["32"], got["bf16-mixed"]
    assert set(f32) <= {"all-reduce f32", "all-gather f32"}, got
    spec, data = make_model("gpt"), 2 if layout != "data" else 4
    # (16 samples over the data axis, each block's 4 all-reduces of (B, T, width))
    split = 0 if layout == "data" else spec.layers * 4 * 16 // data * spec.context * spec.width
    assert bf16.get("all-reduce bf16", 0) == split * 2, got
    assert bf16["all-reduce f32"] == f32["all-reduce f32"] - split * 4, got
    if "all-gather f32" in f32:
        assert bf16 == {**bf16, "all-gather bf16": f32["all-gather f32"] // 2}, got
        assert "all-gather f32" not in bf16, got
