"""jax-pjit and jax-pmap pipeline stages (``adapters/jax_*/pipeline.py`` over ``adapters/_jax/``)
against the float64 numpy reference.

In this process (2 CPU devices, conftest), both backends: S = 2 stages, D = 1, every schedule,
state round trips, activations held and bad input; jax-pjit also native models, checkpoint
pieces and timelines; native models with BatchNorm statistics and dropout (S = 2, and S = 1
with D = 2) against data parallelism. Under mpirun (slow): the stages in different
processes, D = 1 and D = 2 (4 devices), ppermute across processes (jax-pjit; jax-pmap at D = 2
with two devices per process).
"""

from __future__ import annotations

import sys
import weakref
from pathlib import Path

import numpy as np
import pytest

import adapters
import toolkit
from toolkit.equivalence import load_data, make_model
from toolkit.models.reference import reference_run
from toolkit.parallel.pipeline.timeline import idle_fraction, peak_in_flight

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(ROOT / "tests" / "scripts" / "pipeline_jax_worker.py")
sys.path.insert(0, str(ROOT / "tests" / "scripts"))
from pipeline_jax_worker import attach  # noqa: E402

STEPS, BATCH = 6, 32
BACKENDS = ("jax-pjit", "jax-pmap")


def pipelined(layout: str, dtype: str = "float64", backend: str = "jax-pjit"):
    adapter = adapters.get(backend, dtype=dtype)
    adapter.setup(toolkit.current_env())
    return adapter, attach(adapter, toolkit.parse_layout(layout), samples="process")


def fit(adapter, model, optimizer, steps=STEPS):
    x, y = load_data("mlp", "float64")
    trainer = toolkit.Trainer(adapter, model, optimizer, global_batch_size=BATCH,
                              max_steps=steps, seed=0, progress=False)
    return trainer.fit(x, y).losses


def deviations(losses, state, model, optimizer, steps=STEPS, names=None):
    x, y = load_data("mlp", "float64")
    ref_losses, ref_params = reference_run(model, optimizer, "cross_entropy", x, y,
                                           global_batch_size=BATCH, steps=steps, seed=0)
    loss_dev = float(np.max(np.abs(np.asarray(losses) - ref_losses) / np.abs(ref_losses)))
    names = names or {k: k for k in ref_params}
    param_dev = max(float(np.max(np.abs(state[f"params/{names[k]}"] - v)))
                    for k, v in ref_params.items())
    return loss_dev, param_dev


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout,layers", [("pipeline:2:4:gpipe", 1), ("pipeline:2:8:1f1b", 1),
                                           ("pipeline:2:4:interleaved-1f1b:2", 3)])
def test_stages_in_one_process_equal_the_reference(backend, layout, layers):
    model = toolkit.MLP((64, *[32] * layers, 10))
    optimizer = toolkit.Adam(lr=1e-3)
    adapter, pipe = pipelined(layout, backend=backend)
    losses = fit(adapter, model, optimizer)
    loss_dev, param_dev = deviations(losses, adapter.state_dict(), model, optimizer)
    assert loss_dev < 1e-10 and param_dev < 1e-10, (loss_dev, param_dev)
    # Every stage ran a forward and a backward of every micro-batch (and chunk) in the last step.
    records = pipe.timeline()
    last = [r for r in records if r["step"] == STEPS - 1]
    layout = toolkit.parse_layout(layout)
    for stage in (0, 1):
        computes = [r["action"] for r in last if r["stage"] == stage and r["action"][0] in "FB"]
        assert len(computes) == 2 * layout.micro_batches * layout.chunks
    assert all(r["end"] >= r["start"] for r in last)


@pytest.mark.parametrize("backend", BACKENDS)
def test_1f1b_holds_fewer_activations_than_gpipe(backend):
    held = {}
    for schedule in ("gpipe", "1f1b"):
        adapter, pipe = pipelined(f"pipeline:2:8:{schedule}", backend=backend)
        fit(adapter, make_model("mlp"), toolkit.SGD(lr=0.05), steps=2)
        held[schedule] = (pipe.memory_bytes()["activations"],
                          peak_in_flight([r for r in pipe.timeline() if r["step"] == 1]))
    assert held["gpipe"][1] == {0: 8, 1: 8} and held["1f1b"][1] == {0: 2, 1: 1}
    assert held["1f1b"][0] * 4 == held["gpipe"][0]  # box slots: 2 against 8


# (jax-pmap with make test-long: both executors run the same programs, adapters/_jax/programs.py)
@pytest.mark.parametrize("backend", ["jax-pjit", pytest.param("jax-pmap", marks=pytest.mark.long)])
def test_without_recomputation_the_forwards_keep_what_the_backwards_need(backend):
    """Without activation checkpointing each piece's forward hands its micro-batch's backward
    the activations it needs (``adapters/_jax/residuals.py``): every backward program then has
    two matrix products per product of its piece's forward (the gradients of both operands)
    and runs none of the forward's again, as it does when recomputing. The stages hold those
    activations between a micro-batch's forward and backward, more under GPipe (every forward
    first) than under 1F1B, none when recomputing. The losses are the same (bit for bit under
    1F1B; GPipe's within 1e-7, XLA fusing the forward programs apart)."""
    import re

    runs = {}
    for recompute, schedule in ((True, "1f1b"), (False, "1f1b"), (False, "gpipe")):
        adapter, pipe = pipelined(f"pipeline:2:4:{schedule}", "float32", backend)
        x, y = load_data("gpt", "float32")
        trainer = toolkit.Trainer(adapter, make_model("gpt"), toolkit.SGD(lr=0.1, momentum=0.9),
                                  global_batch_size=BATCH, max_steps=3, seed=0, progress=False,
                                  activation_checkpointing=recompute)
        losses = np.asarray(trainer.fit(x, y).losses)
        dots = {branch: len(re.findall(r"= \S+ dot\(", program.as_text()))
                for (branch, _), program in pipe.local.cache.items()}  # (1 + 2k, 2 + 2k)
        pairs = [(dots[1 + 2 * k], dots[2 + 2 * k]) for k in range(2)]
        runs[recompute, schedule] = losses, pipe.memory_bytes()["kept_for_backward"], pairs
    (plain, kept, pairs), (again, none, redone) = runs[False, "1f1b"], runs[True, "1f1b"]
    assert all(b == 2 * f for f, b in pairs), pairs
    assert all(b > 2 * f for f, b in redone) and pairs != redone, redone
    assert none == 0 < kept < runs[False, "gpipe"][1], (none, kept, runs[False, "gpipe"][1])
    assert np.array_equal(plain, again), (plain, again)
    assert np.allclose(runs[False, "gpipe"][0], plain, rtol=1e-6, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_activations_are_held_and_exchanged_in_16_bits(backend):
    """Under bf16-mixed every activation between the MLP's pieces is bfloat16, so the box the
    stages exchange it in is too: half the bytes held (and moved) of a float32 run's."""
    held = {}
    for precision in ("32", "bf16-mixed"):
        adapter = adapters.get(backend, precision=precision)
        adapter.setup(toolkit.current_env())
        pipe = attach(adapter, toolkit.parse_layout("pipeline:2:4"), samples="process")
        x, y = load_data("mlp", "float32")
        toolkit.Trainer(adapter, make_model("mlp"), toolkit.SGD(lr=0.05), global_batch_size=BATCH,
                        max_steps=2, seed=0, progress=False).fit(x, y)
        held[precision] = (pipe.box.dtype.name, pipe.memory_bytes()["activations"])
    assert held["32"][0] == "float32" and held["bf16-mixed"][0] == "bfloat16", held
    assert held["bf16-mixed"][1] * 2 == held["32"][1], held


@pytest.mark.parametrize("backend", BACKENDS)
def test_memory_counts_the_parameters_sliced_for_the_next_step(backend):
    """Between steps a stage holds its flat vector and, queued behind the update, its
    parameters by name for the next step: memory_bytes counts both."""
    adapter, pipe = pipelined("pipeline:2:4:gpipe", backend=backend)
    x, y = load_data("mlp", "float64")
    adapter.build(make_model("mlp"), toolkit.SGD(lr=0.05), "cross_entropy")
    flat = pipe.memory_bytes()["params"]
    adapter.train_step(x[:32], y[:32], 0.05)
    by_name = sum(v.nbytes for k, v in adapter.state_dict().items() if k.startswith("params/"))
    assert flat >= by_name > 0
    assert pipe.memory_bytes()["params"] == flat + by_name


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_stage_never_holds_two_by_name_copies(backend):
    """The step's by-name parameters are dropped before the next step's are sliced."""
    adapter, pipe = pipelined("pipeline:2:4:gpipe", backend=backend)
    x, y = load_data("mlp", "float64")
    adapter.build(make_model("mlp"), toolkit.SGD(lr=0.05), "cross_entropy")
    adapter.train_step(x[:32], y[:32], 0.05)  # compiles; slices the next step's parameters
    used = [weakref.ref(a) for named in pipe._sliced[1].values() for a in named.values()]
    alive, slice_params = [], pipe.local.params

    def counting(stage, block):
        alive.append(sum(ref() is not None for ref in used))
        return slice_params(stage, block)
    pipe.local.params = counting
    adapter.train_step(x[32:64], y[32:64], 0.05)  # uses them, then slices the next ones
    assert alive == [0, 0]  # one slice per stage (both here), none while the old were held


@pytest.mark.long
@pytest.mark.slow  # in one process, but compiling the GPT's stage programs takes a while
def test_tied_gpt_float32_and_its_checkpoint_pieces():
    model = toolkit.GPT(vocab=256, context=16, width=32, layers=2, heads=2)
    optimizer = toolkit.SGD(lr=0.05, momentum=0.9)
    adapter, pipe = pipelined("pipeline:2:4:1f1b", dtype="float32")
    x, y = load_data("gpt", "float32")
    trainer = toolkit.Trainer(adapter, model, optimizer, global_batch_size=16, max_steps=4,
                              seed=0, progress=False)
    losses = trainer.fit(x[:256], y[:256]).losses
    ref_losses, ref_params = reference_run(model, optimizer, "cross_entropy", x[:256], y[:256],
                                           global_batch_size=16, steps=4, seed=0)
    state = adapter.state_dict()
    assert np.max(np.abs(np.asarray(losses) - ref_losses) / np.abs(ref_losses)) < 1e-5
    assert max(np.max(np.abs(state[f"params/{k}"] - v)) for k, v in ref_params.items()) < 1e-5
    assert pipe.staged.shared == {"tok_emb": (0, 1)}
    replicated, pieces = pipe.sharded_state()
    assert replicated == {}  # SGD: no step count
    assert set(pieces) == set(state)  # tok_emb once, its momentum once
    for name, (piece, axis, shape) in pieces.items():  # one process owns both stages here
        assert axis == 0 and np.array_equal(piece.reshape(shape), state[name])


@pytest.mark.parametrize("backend", BACKENDS)
def test_state_round_trip_continues_identically(backend):
    model, optimizer = make_model("mlp"), toolkit.Adam(lr=1e-3)
    adapter, _ = pipelined("pipeline:2:4:1f1b", backend=backend)
    x, y = load_data("mlp", "float64")
    adapter.build(model, optimizer, "cross_entropy")
    adapter.train_step(x[:32], y[:32], 1e-3)
    saved = adapter.state_dict()
    first = float(adapter.train_step(x[32:64], y[32:64], 1e-3))
    other, _ = pipelined("pipeline:2:8:gpipe", backend=backend)  # another schedule, same tensors
    other.build(model, optimizer, "cross_entropy", seed=5)
    other.train_step(x[:32], y[:32], 1e-3)  # its parameters' slices are ready for a next step
    other.load_state_dict(saved)  # ... which must use the loaded parameters instead
    assert float(other.train_step(x[32:64], y[32:64], 1e-3)) == pytest.approx(first, rel=1e-13)
    assert other.evaluate(x[:50], y[:50])["count"] == 50.0


def test_native_list_of_flax_modules():
    import flax.linen as nn
    import jax

    class Relu(nn.Module):
        def __call__(self, h):
            return nn.relu(h)

    model = make_model("mlp")
    init = model.init(0, "float64")
    layers = [(nn.Dense(128, param_dtype=jax.numpy.float64),
               {"params": {"kernel": init["layers.0.kernel"], "bias": init["layers.0.bias"]}}),
              (Relu(), {}),
              (nn.Dense(10, param_dtype=jax.numpy.float64),
               {"params": {"kernel": init["layers.1.kernel"], "bias": init["layers.1.bias"]}})]
    optimizer = toolkit.SGD(lr=0.05, momentum=0.9)
    adapter, pipe = pipelined("pipeline:2:4:1f1b")
    losses = fit(adapter, layers, optimizer)
    names = {"layers.0.kernel": "0.kernel", "layers.0.bias": "0.bias",
             "layers.1.kernel": "2.kernel", "layers.1.bias": "2.bias"}
    loss_dev, param_dev = deviations(losses, adapter.state_dict(), model, optimizer,
                                     names=names)
    assert loss_dev < 1e-10 and param_dev < 1e-10
    assert pipe.staged.piece_names == [("0.kernel", "0.bias"), ("2.kernel", "2.bias")]


def check_a_sequential_mlp(backend, make, first, second, pieces):
    """The digits MLP as a native sequential model (``make()``: with the spec's initial weights,
    its dense layers named ``first`` and ``second``) under Pipeline(2, 4, "1f1b") trains as
    the reference does (1e-10), cut into ``pieces``; data parallel trains it alike, under the
    same names."""
    model, optimizer = make_model("mlp"), toolkit.SGD(lr=0.05, momentum=0.9)
    adapter, pipe = pipelined("pipeline:2:4:1f1b", backend=backend)
    losses = fit(adapter, make(), optimizer)
    names = {f"layers.{i}.{leaf}": f"{prefix}.{leaf}" for i, prefix in enumerate((first, second))
             for leaf in ("kernel", "bias")}
    loss_dev, param_dev = deviations(losses, adapter.state_dict(), model, optimizer,
                                     names=names)
    assert loss_dev < 1e-10 and param_dev < 1e-10
    assert pipe.staged.piece_names == pieces
    data = adapters.get(backend, dtype="float64")
    np.testing.assert_allclose(losses, fit(data, make(), optimizer), rtol=1e-10)
    assert sorted(k for k in data.state_dict() if k.startswith("params/")) == \
        sorted(f"params/{n}" for n in names.values())


@pytest.mark.parametrize("backend", [  # (jax-pmap with make test-long: the same cut)
    "jax-pjit", pytest.param("jax-pmap", marks=pytest.mark.long)])
def test_a_flax_sequential_pipelines_under_data_parallels_names(backend):
    """A ``(flax.linen.Sequential, variables)`` pair, as data parallelism takes it, is cut by
    layer (its ``nn.relu`` a function, no parameters), its parameters under the Sequential's
    own names (``layers_0.kernel``); integer model state is refused, naming it."""
    import flax.linen as nn
    import jax

    init = make_model("mlp").init(0, "float64")
    f64 = jax.numpy.float64
    seq = nn.Sequential([nn.Dense(128, param_dtype=f64), nn.relu, nn.Dense(10, param_dtype=f64)])
    variables = {"params": {
        "layers_0": {"kernel": init["layers.0.kernel"], "bias": init["layers.0.bias"]},
        "layers_2": {"kernel": init["layers.1.kernel"], "bias": init["layers.1.bias"]}}}
    check_a_sequential_mlp(backend, lambda: (seq, variables), "layers_0", "layers_2",
                           [("layers_0.kernel", "layers_0.bias"),
                            ("layers_2.kernel", "layers_2.bias")])

    class Counted(nn.Module):  # model state a flat floating vector cannot carry
        @nn.compact
        def __call__(self, h):
            self.variable("counts", "n", lambda: jax.numpy.zeros((), jax.numpy.int32))
            return h

    counted = nn.Sequential([nn.Dense(4), Counted()])
    with pytest.raises(toolkit.ToolkitError, match=r"layer 1 \(Counted\) holds the int32 "
                                                   r"model state counts/layers_1.n"):
        pipelined("pipeline:2:4", backend=backend)[0].build(
            (counted, counted.init(jax.random.key(0), np.zeros((1, 3)))), toolkit.SGD(lr=0.1),
            "cross_entropy")


@pytest.mark.parametrize("backend", [  # (jax-pjit with make test-long: the same cut)
    pytest.param("jax-pjit", marks=pytest.mark.long), "jax-pmap"])
def test_an_nnx_sequential_pipelines_under_data_parallels_names(backend):
    """A Flax NNX ``nnx.Sequential`` (its ``nnx.relu`` a function) is cut by layer, each an
    NNX module run through its own state, under the names data parallelism gives it
    (``layers.0.kernel``); another NNX module is refused."""
    import jax.numpy as jnp
    from flax import nnx

    init = make_model("mlp").init(0, "float64")

    def seq():
        rngs = nnx.Rngs(0)
        made = nnx.Sequential(nnx.Linear(64, 128, param_dtype=jnp.float64, rngs=rngs), nnx.relu,
                              nnx.Linear(128, 10, param_dtype=jnp.float64, rngs=rngs))
        for layer, i in ((made.layers[0], 0), (made.layers[2], 1)):
            layer.kernel[...] = jnp.asarray(init[f"layers.{i}.kernel"])
            layer.bias[...] = jnp.asarray(init[f"layers.{i}.bias"])
        return made

    check_a_sequential_mlp(backend, seq, "layers.0", "layers.2",
                           [("layers.0.bias", "layers.0.kernel"),
                            ("layers.2.bias", "layers.2.kernel")])
    with pytest.raises(toolkit.ToolkitError, match="cannot cut the NNX module Linear"):
        pipelined("pipeline:2:4", backend=backend)[0].build(
            nnx.Linear(2, 2, rngs=nnx.Rngs(0)), toolkit.SGD(lr=0.1), "cross_entropy")


# ---------------------------------------------------------------- model state (BatchNorm)
def batchnorm_sequential(dtype: str = "float64"):
    """A ``(Sequential, variables)`` pair of 8 layers: two Dense-BatchNorm-ReLU blocks, dropout
    and a dense head, as an ``nn.Sequential`` subclass that hands the mode to its BatchNorm and
    Dropout layers (data parallelism passes ``train`` to the model; a plain ``nn.Sequential``
    would give it to its first layer only)."""
    import flax.linen as nn
    import jax

    class Sequential(nn.Sequential):
        def __call__(self, x, train: bool = False):
            for layer in self.layers:
                if isinstance(layer, nn.BatchNorm):
                    x = layer(x, use_running_average=not train)
                elif isinstance(layer, nn.Dropout):
                    x = layer(x, deterministic=not train)
                else:
                    x = layer(x)
            return x

    kind = getattr(jax.numpy, dtype)
    seq = Sequential([nn.Dense(32, param_dtype=kind), nn.BatchNorm(momentum=0.8, param_dtype=kind),
                      nn.relu, nn.Dense(32, param_dtype=kind),
                      nn.BatchNorm(momentum=0.8, param_dtype=kind), nn.relu, nn.Dropout(0.2),
                      nn.Dense(10, param_dtype=kind)])
    return seq, seq.init(jax.random.key(0), np.zeros((1, 64), dtype))


def fit_alike(adapter, model, accumulation_steps=1, steps=STEPS):
    """Losses, the state after ``steps`` and the evaluation sums over 100 samples."""
    x, y = load_data("mlp", "float64")
    trainer = toolkit.Trainer(adapter, model, toolkit.SGD(lr=0.05, momentum=0.9),
                              global_batch_size=BATCH, max_steps=steps, seed=0, progress=False,
                              accumulation_steps=accumulation_steps)
    losses = trainer.fit(x, y).losses
    return losses, adapter.state_dict(), adapter.evaluate(x[:100], y[:100])


def check_equals_data_parallel(backend, layout, data, make):
    """``make()`` under ``layout`` (this process's two devices) against ``data``'s data
    parallelism with ``M`` accumulation steps (programs.py's rule: one pipeline replica is
    jax-pjit's global micro-batches, two are jax-pmap's devices): every loss, parameter,
    optimizer slot and BatchNorm statistic, the evaluation (with the running averages) alike,
    under the same names, the statistics moved from their start."""
    adapter, _ = pipelined(layout, backend=backend)
    losses, state, evaluation = fit_alike(adapter, make())
    want = fit_alike(adapters.get(data, dtype="float64"), make(),
                     toolkit.parse_layout(layout).micro_batches)
    np.testing.assert_allclose(losses, want[0], rtol=1e-10)
    assert sorted(state) == sorted(want[1])
    stats = [n for n in state if n.startswith("buffers/")]
    assert len(stats) == 4, sorted(state)
    for name in state:
        np.testing.assert_allclose(state[name], want[1][name], rtol=0, atol=1e-10, err_msg=name)
    for name in stats:  # (a running mean starts at 0, a running variance at 1)
        assert not np.allclose(state[name], 0.0 if name.endswith("mean") else 1.0), name
    assert evaluation == pytest.approx(want[2], rel=1e-10)


@pytest.mark.parametrize("backend,layout,data", [
    ("jax-pjit", "pipeline:2:4:1f1b", "jax-pjit"),
    ("jax-pmap", "pipeline:1:2", "jax-pmap"),  # two replicas: their statistics averaged
    # two chunks a stage: both of stage 0's pieces hold BatchNorm statistics
    ("jax-pjit", "pipeline:2:4:interleaved-1f1b:2", "jax-pjit"),
    # (make test-long: the other backend of each)
    pytest.param("jax-pmap", "pipeline:2:4:gpipe", "jax-pjit", marks=pytest.mark.long),
    pytest.param("jax-pjit", "pipeline:1:2", "jax-pmap", marks=pytest.mark.long)])
def test_batchnorm_statistics_in_stages_equal_data_parallel(backend, layout, data):
    """A Linen Sequential with BatchNorm and dropout: each stage holds its layers' statistics,
    each micro-batch's forward moves them in order (as accumulation steps do), the replicas of
    a stage average them after the step, and a layer draws the dropout mask data parallelism
    draws: the pipeline equals data parallel (float64, 1e-10)."""
    check_equals_data_parallel(backend, layout, data, batchnorm_sequential)


@pytest.mark.parametrize("backend", [  # (jax-pjit with make test-long: the same mechanism)
    pytest.param("jax-pjit", marks=pytest.mark.long), "jax-pmap"])
def test_an_nnx_sequential_with_batchnorm_equals_data_parallel(backend):
    """An ``nnx.Sequential`` with ``nnx.BatchNorm`` (its ``nnx.BatchStat`` checkpointed as
    ``buffers/state/...``) and two ``nnx.Dropout`` on different stages: each layer's random
    stream is numbered as in the whole model, so it draws data parallelism's masks."""
    import jax.numpy as jnp
    from flax import nnx

    def make():
        r, f64 = nnx.Rngs(0), jnp.float64
        return nnx.Sequential(
            nnx.Linear(64, 32, param_dtype=f64, rngs=r),
            nnx.BatchNorm(32, momentum=0.8, param_dtype=f64, rngs=r), nnx.relu,
            nnx.Dropout(0.3, rngs=r), nnx.Linear(32, 32, param_dtype=f64, rngs=r),
            nnx.BatchNorm(32, momentum=0.8, param_dtype=f64, rngs=r), nnx.relu,
            nnx.Dropout(0.2, rngs=r), nnx.Linear(32, 10, param_dtype=f64, rngs=r))

    check_equals_data_parallel(backend, "pipeline:2:4:1f1b", "jax-pjit", make)


def test_a_skipped_step_keeps_the_stages_batchnorm_statistics():
    """``on_nonfinite="skip"``: a step whose batch holds a NaN changes no parameter, slot or
    statistic (its forwards moved them on the devices); the next step moves them again."""
    x, y = load_data("mlp", "float32")
    x = np.array(x)
    x[2 * BATCH + 5] = np.nan  # (no shuffling: the third step's batch)
    adapter, _ = pipelined("pipeline:2:2", dtype="float32")
    trainer = toolkit.Trainer(adapter, batchnorm_sequential("float32"), toolkit.Adam(lr=1e-2),
                              global_batch_size=BATCH, max_steps=2, seed=0, progress=False,
                              shuffle=False, on_nonfinite="skip")
    trainer.fit(x, y)
    before = adapter.state_dict()
    trainer.max_steps = 3
    assert trainer.fit(x, y).skipped_steps == [3]
    at = adapter.state_dict()
    assert before["rng/step"] == 2 and at["rng/step"] == 3  # (the next step's masks move on)
    for name in before:
        if name != "rng/step":
            assert np.array_equal(before[name], at[name]), name
    trainer.max_steps = 4
    trainer.fit(x, y)
    after = adapter.state_dict()
    assert all(not np.array_equal(after[n], at[n]) for n in after if n.startswith("buffers/"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_checkpoint_moves_between_data_parallel_and_the_stages(backend):
    """Data parallel's state (``buffers/batch_stats/...``, ``rng/step``) loaded into a pipeline
    continues as data parallel does; the pipeline's checkpoint pieces hold every statistic
    whole, once, and the step count."""
    x, y = load_data("mlp", "float64")
    data = adapters.get("jax-pjit", dtype="float64")
    data.setup(toolkit.current_env())
    data.build(batchnorm_sequential(), toolkit.SGD(lr=0.05, momentum=0.9), "cross_entropy",
               accumulation_steps=2)
    for i in range(2):
        data.train_step(x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH], 0.05)
    adapter, pipe = pipelined("pipeline:2:2", backend=backend)
    adapter.build(batchnorm_sequential(), toolkit.SGD(lr=0.05, momentum=0.9), "cross_entropy")
    adapter.train_step(x[-BATCH:], y[-BATCH:], 0.05)  # (what it loads must replace all this)
    adapter.load_state_dict(data.state_dict())
    batch = x[2 * BATCH:3 * BATCH], y[2 * BATCH:3 * BATCH]
    assert float(adapter.train_step(*batch, 0.05)) == pytest.approx(
        float(data.train_step(*batch, 0.05)), rel=1e-12)
    state, want = adapter.state_dict(), data.state_dict()
    assert sorted(state) == sorted(want) and state["rng/step"] == want["rng/step"] == 3
    for name in want:
        np.testing.assert_allclose(state[name], want[name], rtol=0, atol=1e-12, err_msg=name)
    replicated, pieces = pipe.sharded_state()
    assert replicated == {"rng/step": 3}
    assert set(pieces) == set(state) - {"rng/step"}
    for name, (piece, axis, shape) in pieces.items():  # (one process holds both stages here)
        assert axis == 0 and np.array_equal(piece.reshape(shape), state[name]), name


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_is_a_clear_error(backend):
    import flax.linen as nn

    spec, opt = make_model("mlp"), toolkit.SGD(lr=0.1)
    adapter, _ = pipelined("pipeline:3:4", backend=backend)  # 2 devices here
    with pytest.raises(toolkit.ToolkitError, match="2 devices .* do not divide into 3"):
        adapter.build(toolkit.MLP((64, 32, 32, 10)), opt, "cross_entropy")
    adapter, _ = pipelined("pipeline:2:3:gpipe", backend=backend)
    adapter.build(spec, opt, "cross_entropy")
    x, y = load_data("mlp", "float64")
    with pytest.raises(toolkit.ToolkitError, match="3 micro-batches do not divide the local "
                                                   "batch of 16"):
        adapter.train_step(x[:16], y[:16], 0.1)
    adapter, _ = pipelined("pipeline:2:4", backend=backend)
    module = nn.Dense(10)
    with pytest.raises(toolkit.ToolkitError, match="needs a sequential model"):
        adapter.build((module, {"params": {}}), opt, "cross_entropy")
    with pytest.raises(toolkit.ToolkitError, match="needs a sequential model"):
        adapter.build(module, opt, "cross_entropy")
    with pytest.raises(toolkit.ToolkitError, match="CNN"):
        adapter.build(toolkit.CNN(image_shape=(8, 8, 1), channels=(4,), classes=10), opt,
                      "cross_entropy")
    with pytest.raises(toolkit.ToolkitError, match="sync_batchnorm is not available"):
        adapter.build(spec, opt, "cross_entropy", sync_batchnorm=True)
    with pytest.raises(toolkit.ToolkitError, match="accumulation_steps=2 with a pipeline"):
        adapter.build(spec, opt, "cross_entropy", accumulation_steps=2)
    adapter, _ = pipelined("pipeline:2:4:interleaved-1f1b:2", backend=backend)
    with pytest.raises(toolkit.ToolkitError, match="2 stages x 2 chunks for a model of 2"):
        adapter.build(spec, opt, "cross_entropy")


def results(job) -> dict[int, dict]:
    return {rank: rows[-1] for rank, rows in job.results_by_rank.items()}


LONG = pytest.mark.long


@pytest.mark.slow
@pytest.mark.parametrize("backend,nproc,argv,tolerance", [
    pytest.param("jax-pjit", 2, ["--layout", "pipeline:2:4:1f1b", "--model", "gpt", "--dtype",
                                 "float32", "--batch-size", "16"], 1e-5, marks=LONG),
    pytest.param("jax-pjit", 2, ["--layout", "pipeline:2:8:gpipe", "--local-devices", "2",
                                 "--model", "mlp"], 1e-10, marks=LONG),
    pytest.param("jax-pjit", 4, ["--layout", "pipeline:2:8:1f1b", "--model", "mlp",
                                 "--optimizer", "sgd"], 1e-10, marks=LONG),
    # pmap's grouped psum over a stage's replicas, the replicas in one process (D = 2)
    pytest.param("jax-pmap", 2, ["--layout", "pipeline:2:8:gpipe", "--local-devices", "2",
                                 "--model", "mlp"], 1e-10, marks=LONG),
    pytest.param("jax-pmap", 2, ["--layout", "pipeline:2:4:1f1b", "--model", "gpt", "--dtype",
                                 "float32", "--batch-size", "16"], 1e-5, marks=LONG),
    pytest.param("jax-pmap", 4, ["--layout", "pipeline:2:4:interleaved-1f1b:2", "--layers",
                                 "3", "--model", "mlp", "--optimizer", "sgd"], 1e-10,
                 marks=LONG),
])
def test_stages_across_processes_equal_the_reference(launch, tmp_path, backend, nproc, argv,
                                                     tolerance):
    job = launch("any", nproc, [WORKER, "--backend", backend, *argv, "--steps", "20",
                                             "--pieces-dir", str(tmp_path)], timeout=400)
    assert job.returncode == 0, job
    got = results(job)
    assert sorted(got) == list(range(nproc)), job
    assert got[0]["max_rel_loss_dev"] < tolerance and got[0]["max_abs_param_dev"] < tolerance
    # The processes hold different stages: each timed its own forwards and backwards.
    stages = {s for r in got.values() for s in r["stages_here"]}
    assert stages == {0, 1}
    records = [r for res in got.values() for r in res["records"] if r["replica"] == 0]
    assert 0 < idle_fraction(records) < 1
    # Replica 0 of each stage wrote it whole; any layout reads full tensors back.
    from toolkit.checkpoint.store import read_checkpoint

    ckpt = read_checkpoint(next(tmp_path.glob("step_*")))
    with np.load(tmp_path / "full.npz") as full:
        assert set(full.files) == set(ckpt.tensors)
        for name in full.files:
            assert np.array_equal(full[name], ckpt.tensors[name]), name
