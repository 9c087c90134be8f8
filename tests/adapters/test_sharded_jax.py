"""The JAX backends' sharded layouts: their collectives against numpy (large chunks, two
processes), the bytes each stage holds against the flat-shard arithmetic, tensor parallelism of
the GPT against the reference, native Flax modules, and the bad-input errors.

In-process tests run on the 2 CPU devices tests/conftest.py gives this process.
"""

import json

import numpy as np
import pytest

import adapters
import toolkit
from toolkit.datasets import load_digits
from toolkit.equivalence import LOSS_TOLERANCE, PARAM_TOLERANCE
from toolkit.models.reference import reference_run
from toolkit.parallel.shards import unit_layouts

JAX = ("jax-pjit", "jax-pmap")


def digits_like(n=48, features=5, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, features)).astype(np.float32), rng.integers(0, classes, n)


def train(backend, model, layout, steps=3, batch=16, data=None, **kw):
    adapter = adapters.get(backend)
    x, y = data if data is not None else digits_like()
    trainer = toolkit.Trainer(adapter, model, kw.pop("optimizer", toolkit.Adam(lr=1e-2)),
                              global_batch_size=batch, max_steps=steps, progress=False,
                              layout=layout, **kw)
    history = trainer.fit(x, y)
    return adapter, trainer, history


def tiny_gpt(heads=2):
    from toolkit.models.gpt import GPT

    return GPT(vocab=32, context=8, width=8 * heads, layers=2, heads=heads)


def gpt_data(n=32, context=8, vocab=32):
    tokens = np.random.default_rng(1).integers(0, vocab, n * context + 1)
    return tokens[:-1].reshape(n, context), tokens[1:].reshape(n, context)


@pytest.mark.long
@pytest.mark.slow
def test_collectives_against_numpy_with_large_chunks_across_two_processes(launch):
    job = launch("any", 2, ["tests/scripts/jax_sharded_worker.py"], timeout=300)
    assert job.returncode == 0, job
    for check in ("pmap psum_scatter+all_gather 1.1 MiB", "pmap psum_scatter+all_gather 4.4 MiB",
                  "pjit reduce-scatter+all-gather 1.1 MiB",
                  "pjit reduce-scatter+all-gather 4.4 MiB", "stage-3 pieces of rank 0",
                  "stage-3 pieces of rank 1"):
        assert f"ok {check}" in job.stdout, (check, job)


def check_memory_bytes(adapter, model, stage):
    """Two local devices: a replicated buffer is held twice, a sharded one once in all; the
    second unit (18 + 3 elements) is padded to 22."""
    layouts = unit_layouts({k: v.shape for k, v in model.init(0).items()}, 2)
    padded = sum(layout.padded for layout in layouts.values()) * 4  # float32 bytes
    assert padded == (36 + 22) * 4
    replicated, sharded = 2 * padded, padded
    assert adapter.memory_bytes() == {
        "params": sharded if stage == 3 else replicated,
        "grads": replicated if stage == 1 else sharded,
        "optimizer": 2 * sharded}  # Adam's two slots


@pytest.mark.parametrize("backend", JAX)
@pytest.mark.parametrize("stage", [1, 2])  # stage 3: in the next test
def test_memory_bytes_of_each_stage_are_the_real_buffers(backend, stage):
    model = toolkit.MLP((5, 6, 3))
    adapter, _, _ = train(backend, model, toolkit.Sharded(stage=stage), steps=1)
    check_memory_bytes(adapter, model, stage)


@pytest.mark.parametrize("backend", JAX)
def test_stage_3_with_accumulation_custom_loss_and_metric_equals_data_parallel(backend):
    import jax.numpy as jnp

    def loss(out, y):  # cross-entropy written by the user
        logp = out - jax_logsumexp(jnp, out)
        return -jnp.take_along_axis(logp, y[:, None], axis=1)[:, 0]

    def top_logit(out, y):
        return jnp.max(out, axis=1)

    runs = {}
    for layout in (toolkit.DataParallel(), toolkit.Sharded(stage=3)):
        adapter, trainer, history = train(backend, toolkit.MLP((5, 6, 3)), layout, loss=loss,
                                          metrics={"top": top_logit}, accumulation_steps=2)
        x, y = digits_like(20, seed=3)
        runs[layout.name] = (history.losses, trainer.evaluate(x, y), adapter.state_dict())
    check_memory_bytes(adapter, toolkit.MLP((5, 6, 3)), 3)
    (dp_losses, dp_eval, dp_state), (losses, evaluated, state) = runs.values()
    np.testing.assert_allclose(losses, dp_losses, rtol=1e-6)
    assert evaluated.keys() == dp_eval.keys() == {"val_loss", "val_top"}
    for key in evaluated:
        assert evaluated[key] == pytest.approx(dp_eval[key], rel=1e-6)
    assert state.keys() == dp_state.keys()
    for name in state:
        np.testing.assert_allclose(state[name], dp_state[name], atol=1e-6, err_msg=name)


@pytest.mark.parametrize("backend", JAX)
def test_checkpoint_pieces_of_padded_units_are_the_owned_slices(backend):
    """Stage 3 on the 2 local devices: the second unit (18 + 3 elements) is padded to 22, so
    its last tensor's piece on device 1 must stop before the padding. Each piece equals the
    slice of the full tensor that ``FlatLayout.owned`` gives this process's devices."""
    model = toolkit.MLP((5, 6, 3))
    adapter, _, _ = train(backend, model, toolkit.Sharded(stage=3), steps=2)
    full = adapter.state_dict()
    replicated, pieces = adapter.sharded_state()
    layouts = unit_layouts({k: v.shape for k, v in model.init(0).items()}, 2)
    assert any(layout.padded > layout.total for layout in layouts.values())
    expected = {}
    for layout in layouts.values():
        for device in (0, 1):
            for name, a, b, _ in layout.owned(device):
                for prefix in ("params", "opt/mu", "opt/nu"):
                    expected.setdefault(f"{prefix}/{name}", []).append(
                        full[f"{prefix}/{name}"].reshape(-1)[a:b])
    assert set(pieces) == set(expected) and set(replicated) == {"opt/count"}
    for name, (piece, axis, shape) in pieces.items():
        assert axis == 0 and tuple(shape) == full[name].shape, name
        np.testing.assert_array_equal(piece, np.concatenate(expected[name]), err_msg=name)


def jax_logsumexp(jnp, out):
    m = jnp.max(out, axis=1, keepdims=True)
    return m + jnp.log(jnp.sum(jnp.exp(out - m), axis=1, keepdims=True))


def test_tensor_parallel_gpt_equals_the_reference():
    """``tensor_parallel=2`` on the 2 local devices: each holds half of every split kernel."""
    spec, (x, y) = tiny_gpt(), gpt_data()
    optimizer = toolkit.Adam(lr=1e-2)
    adapter, _, history = train("jax-pjit", spec, toolkit.Sharded(stage=3, tensor_parallel=2),
                                steps=4, data=(x, y), optimizer=optimizer)
    ref_losses, ref_params = reference_run(spec, optimizer, "cross_entropy", x, y,
                                           global_batch_size=16, steps=4, dtype="float64")
    dev = np.max(np.abs(np.asarray(history.losses) - ref_losses) / np.abs(ref_losses))
    assert dev <= LOSS_TOLERANCE["float32"], dev
    state = adapter.state_dict()
    for name, value in ref_params.items():
        if not name.endswith("attn.qkv.bias"):  # the key bias: see equivalence._comparable
            np.testing.assert_allclose(state[f"params/{name}"], value,
                                       atol=PARAM_TOLERANCE["float32"], err_msg=name)
    fc = adapter.strategy.params["split"]["blocks.0.mlp.fc.kernel"]  # (4w, w) in 2 rows of halves
    assert [s.data.shape for s in fc.addressable_shards] == [(1, 4 * 16 * 16 // 2)] * 2


def tensor_parallel_equivalence(launch, tmp_path, world_sizes, local_devices, dtype, optimizer):
    out = tmp_path / "eq.json"
    job = launch("python", 1, ["-m", "adapters.equivalence", "--backends", "jax-pjit",
                               "--model", "gpt", "--layout", "sharded:3:tp2,sharded:1:tp2",
                               "--local-devices", str(local_devices), "--world-sizes",
                               world_sizes, "--steps", "6", "--dtype", dtype, "--optimizer",
                               optimizer, "--json", str(out)], timeout=600)
    assert job.returncode == 0, job
    rows = json.loads(out.read_text())["results"]
    assert sorted((r["world_size"], r["layout"]) for r in rows) == sorted(
        (int(w), layout) for w in world_sizes.split(",")
        for layout in ("sharded:3:tp2", "sharded:1:tp2")), rows
    for row in rows:
        assert row["status"] == "pass", row
        assert row["max_rel_loss_dev"] <= LOSS_TOLERANCE[dtype], row


# make test runs each dtype and each optimizer once; make test-long the other two pairs (and
# float32 with SGD at one device per process: the two-device processes run it).
# (make test: float64 with AdamW; the other three with make test-long)
DTYPE_OPTIMIZER = [pytest.param("float32", "sgd", marks=pytest.mark.long),
                   pytest.param("float32", "adamw", marks=pytest.mark.long),
                   pytest.param("float64", "sgd", marks=pytest.mark.long), ("float64", "adamw")]
# (at one device per process make test runs 2 ranks; 4 ranks, two replicas of two, with
# make test-long)
ONE_DEVICE = [pytest.param("float32", "sgd", "2,4", marks=pytest.mark.long),
              pytest.param("float32", "adamw", "2,4", marks=pytest.mark.long),
              pytest.param("float64", "sgd", "2,4", marks=pytest.mark.long),
              ("float64", "adamw", "2"), pytest.param("float64", "adamw", "4",
                                                      marks=pytest.mark.long)]


@pytest.mark.slow
@pytest.mark.parametrize(("dtype", "optimizer", "sizes"), ONE_DEVICE)
def test_tensor_parallel_with_one_device_per_process(launch, tmp_path, dtype, optimizer, sizes):
    """One rank per device, as on GPU nodes: the model axis spans processes (2 ranks: one
    replica; 4 ranks: two replicas of two), and equals the float64 reference."""
    tensor_parallel_equivalence(launch, tmp_path, sizes, 1, dtype, optimizer)


@pytest.mark.slow
@pytest.mark.parametrize(("dtype", "optimizer"), DTYPE_OPTIMIZER)
def test_tensor_parallel_on_two_processes_of_two_devices(launch, tmp_path, dtype, optimizer):
    """A (data=2, model=2) mesh across processes: equals the float64 reference."""
    tensor_parallel_equivalence(launch, tmp_path, "2", 2, dtype, optimizer)


@pytest.mark.parametrize(("backend", "stage"), [("jax-pjit", 3), ("jax-pmap", 2)])
def test_a_native_flax_module_is_sharded_by_top_level_submodule(backend, stage):
    import flax.linen as nn
    import jax

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3, name="out")(nn.relu(nn.Dense(7, name="hidden")(x)))

    x, _ = digits_like()
    runs = []
    for layout in (toolkit.DataParallel(), toolkit.Sharded(stage=stage)):
        module = Net()
        adapter, _, history = train(backend, (module, module.init(jax.random.key(0), x[:1])),
                                    layout, optimizer=toolkit.SGD(lr=0.1, momentum=0.9))
        runs.append(history.losses)
    np.testing.assert_allclose(runs[1], runs[0], rtol=1e-6)
    assert list(adapter.strategy.units.layouts) == ["hidden", "out"]


@pytest.mark.parametrize("backend", ["jax-pmap", "jax-pjit"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_native_flax_module_holds_what_the_memory_estimate_says(stage, backend):
    """Every ZeRO stage of a native Flax module (2 devices): the losses equal data parallel's,
    and the bytes the devices hold are ``toolkit.memory.estimate``'s for its parameter count,
    plus only the flat shards' padding (each unit padded to a multiple of the device
    count)."""
    import flax.linen as nn
    import jax

    from toolkit import memory

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3, name="out")(nn.relu(nn.Dense(7, name="hidden")(x)))

    x, _ = digits_like()
    module = Net()
    variables = module.init(jax.random.key(0), x[:1])
    count = sum(a.size for a in jax.tree_util.tree_leaves(variables["params"]))
    runs = {}
    for layout in (toolkit.DataParallel(), toolkit.Sharded(stage=stage)):
        adapter, _, history = train(backend, (module, variables), layout,
                                    optimizer=toolkit.SGD(lr=0.1, momentum=0.9))
        runs[layout.name] = history.losses, adapter.memory_bytes()
    (data, _), (sharded, held) = runs.values()
    np.testing.assert_allclose(sharded, data, rtol=1e-6)
    est = memory.estimate(count, toolkit.Sharded(stage=stage), 2, "float32", "momentum")
    # per-device estimate x 2 devices; the padding: hidden 5*7+7 = 42 (even), out 7*3+3 = 24
    # (even): none here, so the bytes are the estimate's exactly
    assert held == {"params": 2 * est.params, "grads": 2 * est.grads,
                    "optimizer": 2 * est.optimizer}, (held, est)


def refused(backend, model, layout, match, optimizer=None, data=None):
    with pytest.raises(toolkit.ToolkitError, match=match):
        train(backend, model, layout, steps=1, data=data,
              optimizer=optimizer or toolkit.SGD(lr=0.1))


def test_tensor_parallel_that_does_not_divide_the_devices_is_refused():
    refused("jax-pjit", tiny_gpt(heads=3), toolkit.Sharded(3, tensor_parallel=3),
            r"tensor_parallel=3 does not divide the 2 devices", data=gpt_data())


def test_tensor_parallel_that_does_not_divide_the_heads_is_refused():
    refused("jax-pjit", tiny_gpt(heads=1), toolkit.Sharded(3, tensor_parallel=2),
            r"tensor_parallel=2 does not divide the GPT's 1 heads", data=gpt_data())


def test_tensor_parallel_of_a_model_other_than_the_gpt_is_refused():
    refused("jax-pjit", toolkit.MLP((5, 6, 3)), toolkit.Sharded(3, tensor_parallel=2),
            r"toolkit.GPT, not of MLP")


def test_tensor_parallel_in_jax_pmap_is_refused():
    refused("jax-pmap", tiny_gpt(), toolkit.Sharded(3, tensor_parallel=2),
            r"only jax-pjit splits layers", data=gpt_data())


@pytest.mark.parametrize("backend", JAX)
def test_an_optax_transformation_that_is_not_elementwise_is_refused(backend):
    import optax  # (tests/adapters/test_native_optimizers_jax.py: what works, what does not)

    refused(backend, toolkit.MLP((5, 6, 3)), toolkit.Sharded(1),
            r"cannot run the optax transformation chain\(clip_by_global_norm, trace, scale\)",
            optimizer=optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1, momentum=0.9)))


@pytest.mark.parametrize("backend", [  # (jax-pjit's native ZeRO-3 with make test-long)
    pytest.param("jax-pjit", marks=pytest.mark.long), "jax-pmap"])
def test_stage_3_of_a_native_module_with_batchnorm_and_dropout_equals_data_parallel(backend):
    """FSDP of a native Flax module: the whole module is one unit of computation (gathered
    before its forward, again for its backward), its BatchNorm statistics and dropout as data
    parallel's; every step's loss and the final state equal data parallel's; each device
    holds a shard of the parameters."""
    import flax.linen as nn
    import jax

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            h = nn.relu(nn.BatchNorm(use_running_average=not train)(nn.Dense(16)(x)))
            return nn.Dense(10)(nn.Dropout(0.2, deterministic=not train)(h))

    module = Net()
    variables = module.init(jax.random.key(0), np.zeros((1, 64), np.float32))
    (x, y), _ = load_digits()
    runs = {}
    for layout in ("data", "sharded:3"):
        adapter = adapters.get(backend)
        trainer = toolkit.Trainer(adapter, (module, variables), toolkit.SGD(lr=0.1),
                                  layout=layout, global_batch_size=32, max_steps=6,
                                  progress=False, env=toolkit.LaunchEnv())
        runs[layout] = (trainer.fit(x, y).losses, adapter.state_dict(), adapter.memory_bytes())
    (data, data_state, data_bytes), (fsdp, fsdp_state, fsdp_bytes) = runs.values()
    np.testing.assert_allclose(fsdp, data, rtol=1e-6)
    assert sorted(fsdp_state) == sorted(data_state)
    for k in data_state:
        np.testing.assert_allclose(fsdp_state[k], data_state[k], rtol=1e-5, atol=1e-6,
                                   err_msg=k)
    assert fsdp_bytes["params"] < data_bytes["params"]  # (2 devices: each its shards)
