"""jax-pjit and jax-pmap pipeline stages (``adapters/jax_*/pipeline.py`` over ``adapters/_jax/``)
against the float64 numpy reference.

In this process (2 CPU devices, conftest), both backends: S = 2 stages, D = 1, every schedule,
state round trips, activations held and bad input; jax-pjit also native models, checkpoint
pieces and timelines. Under mpirun (slow): the stages in different processes, D = 1 and
D = 2 (4 devices), ppermute across processes (jax-pjit; jax-pmap at D = 2 with two devices per
process).
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
    own names (``layers_0.kernel``)."""
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
    normed = nn.Sequential([nn.Dense(4), nn.BatchNorm(use_running_average=True)])
    with pytest.raises(toolkit.ToolkitError, match=r"layer 1 \(BatchNorm\) has model state "
                                                   r"\['batch_stats'\]"):
        pipelined("pipeline:2:4", backend=backend)[0].build(
            (normed, normed.init(jax.random.key(0), np.zeros((1, 3)))), toolkit.SGD(lr=0.1),
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
