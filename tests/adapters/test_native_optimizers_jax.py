"""The user's own optax transformation under the JAX backends' sharded (ZeRO 1-3) and pipeline
layouts (``adapters/_jax/native_optax.py``): the same losses and state as data parallelism, a
checkpoint that moves between the layouts (and backends), a skipped step that keeps the
schedule's count, and the transformations that read more than one element refused by name.

In this process, on the 2 CPU devices tests/conftest.py gives it: the sharded layouts over both
devices, the pipelines as two stages (one per device), data parallelism over both. Under mpirun
(slow): a checkpoint between two processes' layouts and this process's data parallelism.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import numpy as np
import pytest

import adapters
import toolkit

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(ROOT / "tests" / "scripts" / "native_optax_worker.py")
sys.path.insert(0, str(ROOT / "tests" / "scripts"))
from native_optax_worker import BATCH, MODEL, STEPS, adamw, data  # noqa: E402
from pipeline_jax_worker import attach  # noqa: E402

JAX = ("jax-pjit", "jax-pmap")
TOLERANCE = {"float32": 1e-6, "float64": 1e-12}


def trainer(backend, layout, optimizer, dtype="float32", steps=STEPS, model=MODEL, **kw):
    """A Trainer of ``layout`` (``"data"``, ``"sharded:k"`` or a pipeline over the two
    devices)."""
    adapter = adapters.get(backend, dtype=dtype)
    if layout.startswith("pipeline"):  # two stages over this process's two devices
        adapter.setup(toolkit.current_env())
        attach(adapter, toolkit.parse_layout(layout), samples="process")
        layout = None
    else:
        layout = toolkit.parse_layout(layout)
    return adapter, toolkit.Trainer(adapter, model, optimizer, global_batch_size=BATCH,
                                    max_steps=steps, progress=False, layout=layout, **kw)


@functools.cache
def data_parallel(backend, dtype, clip):
    x, y = data()
    adapter, t = trainer(backend, "data", adamw(), dtype, clip_grad_norm=clip)
    return np.asarray(t.fit(x.astype(dtype), y).losses), adapter.state_dict()


CASES = [("sharded:1", None, "float32"), ("sharded:2", 0.5, "float32"),
         ("sharded:3", None, "float32"), ("pipeline:2:2:1f1b", 0.5, "float32"),
         ("sharded:3", 0.5, "float64"), ("pipeline:2:4:gpipe", None, "float64")]


@pytest.mark.parametrize("backend", JAX)
@pytest.mark.parametrize(("layout", "clip", "dtype"), CASES)
def test_adamw_with_a_schedule_equals_data_parallel(backend, layout, clip, dtype):
    """optax.adamw with a warmup-cosine schedule: 20 steps, the same losses and the same state
    under the same names (optax's per-parameter leaves by parameter, its counts whole)."""
    want_losses, want = data_parallel(backend, dtype, clip)
    x, y = data()
    adapter, t = trainer(backend, layout, adamw(), dtype, clip_grad_norm=clip)
    losses = np.asarray(t.fit(x.astype(dtype), y).losses)
    tol = TOLERANCE[dtype]
    np.testing.assert_allclose(losses, want_losses, rtol=tol, atol=tol)
    got = adapter.state_dict()
    assert got.keys() == want.keys()
    assert {"opt/0.count", "opt/0.mu.layers_0.kernel", "opt/0.nu.layers_2.bias",
            "opt/2.count"} <= got.keys(), sorted(got)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=tol, atol=tol, err_msg=name)
    assert int(got["opt/2.count"]) == STEPS  # the schedule's count: every step


RESUMES = [("jax-pmap", "sharded:3", "jax-pmap", "data"),
           ("jax-pjit", "sharded:3", "jax-pjit", "data"),
           ("jax-pjit", "data", "jax-pmap", "sharded:2"),
           ("jax-pmap", "sharded:1", "jax-pjit", "pipeline:2:2:1f1b")]


@pytest.mark.parametrize(("first", "saved", "second", "resumed"), RESUMES)
def test_a_checkpoint_resumes_on_another_layout(tmp_path, first, saved, second, resumed):
    """Saved after 8 steps (each process its pieces of a sharded state), resumed to 16: the
    losses of the uninterrupted data-parallel run."""
    x, y = data()
    want = np.asarray(data_parallel(second, "float32", None)[0])[8:16]
    _, t = trainer(first, saved, adamw(), steps=8, checkpoint_dir=tmp_path, checkpoint_every=8)
    t.fit(x, y)
    _, t = trainer(second, resumed, adamw(), steps=16, checkpoint_dir=tmp_path,
                   resume="latest")
    history = t.fit(x, y)
    assert history.first_step == 8
    np.testing.assert_allclose(history.losses, want, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("processes_save", [True, False])
def test_a_checkpoint_resumes_across_processes(launch, tmp_path, processes_save):
    """Two processes (one device each) save (jax-pmap, ZeRO-3: each its shards of adamw's
    moments) or resume (jax-pjit, two pipeline stages: each its stage's) what this process
    resumes or saved under data parallelism."""
    x, y = data()
    want = data_parallel("jax-pjit", "float32", None)[0][8:16]
    ckpt = str(tmp_path)
    if processes_save:
        job = launch("any", 2, [WORKER, "jax-pmap", "sharded:3", "8", ckpt])
        assert job.returncode == 0, job
        history = trainer("jax-pjit", "data", adamw(), steps=16, checkpoint_dir=ckpt,
                          resume="latest")[1].fit(x, y)
        losses, first_step = history.losses, history.first_step
    else:
        trainer("jax-pmap", "data", adamw(), steps=8, checkpoint_dir=ckpt,
                checkpoint_every=8)[1].fit(x, y)
        job = launch("any", 2, [WORKER, "jax-pjit", "pipeline:2:2:1f1b", "16", ckpt, "latest"])
        assert job.returncode == 0, job
        (result,) = job.results_by_rank[0]
        losses, first_step = result["losses"], result["first_step"]
    assert first_step == 8
    np.testing.assert_allclose(losses, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("backend", "layout"), [("jax-pjit", "sharded:2"),
                                                 ("jax-pmap", "pipeline:2:2:gpipe")])
def test_a_skipped_step_keeps_the_schedules_count(backend, layout):
    x, y = data()
    x[np.arange(BATCH, 2 * BATCH)] = np.nan  # the second epoch's batches differ: shuffle off
    adapter, t = trainer(backend, layout, adamw(), steps=3, on_nonfinite="skip", shuffle=False)
    history = t.fit(x, y)
    assert history.skipped_steps == [2]
    state = adapter.state_dict()
    assert int(state["opt/0.count"]) == int(state["opt/2.count"]) == 2


def refusal_cases():
    import jax
    import optax

    def kernels(params):
        return jax.tree_util.tree_map(lambda p: p.ndim > 1, params)

    return {
        "lamb": (optax.lamb(1e-3), r"chain\(scale_by_adam, add_decayed_weights, "
                                   r"scale_by_trust_ratio, scale\).*: scale_by_trust_ratio reads"),
        "adafactor": (optax.adafactor(1e-3), r"chain\(scale_by_factored_rms, .*: "
                                             r"clip_by_block_rms and scale_by_param_block_rms"),
        "clip_by_global_norm": (optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
                                r"chain\(clip_by_global_norm, scale_by_adam, scale\).*: "
                                r"clip_by_global_norm reads"),
        "masked_adamw": (optax.adamw(1e-3, mask=kernels), r"masked reads"),
    }


@pytest.mark.parametrize("backend", JAX)
@pytest.mark.parametrize("layout", ["sharded:1", "pipeline:2:2:1f1b"])
@pytest.mark.parametrize("case", ["lamb", "adafactor", "clip_by_global_norm", "masked_adamw"])
def test_a_transformation_that_reads_whole_tensors_is_refused(backend, layout, case):
    optimizer, match = refusal_cases()[case]
    x, y = data()
    _, t = trainer(backend, layout, optimizer, steps=1)
    with pytest.raises(toolkit.ToolkitError, match=f"(?s)the optax transformation .*{match}") \
            as err:
        t.fit(x, y)
    message = str(err.value)
    assert f"under a {toolkit.parse_layout(layout).name} layout" in message
    assert "Trainer(clip_grad_norm=...) instead of clip_by_global_norm" in message


def same_as_data_parallel(backend, layout, optimizer, model, x, y, steps):
    """Trains ``model`` with ``optimizer()`` under data parallelism and ``layout``; asserts the
    same losses and state under the same names, and returns the state."""
    runs = []
    for each in ("data", layout):
        adapter, t = trainer(backend, each, optimizer(), steps=steps, model=model)
        runs.append((np.asarray(t.fit(x, y).losses), adapter.state_dict()))
    (want_losses, want), (losses, got) = runs
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6)
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)
    return got


@pytest.mark.parametrize("backend", JAX)
def test_sgd_with_momentum_and_a_tied_gpt_pipeline(backend):
    """optax.sgd(momentum) passes the probe; the tied embedding of a GPT cut into two stages
    gets one update from both stages' gradients, as data parallelism gives it."""
    import optax

    from toolkit.models.gpt import GPT

    gpt = GPT(vocab=32, context=8, width=16, layers=2, heads=2, tied=True)
    tokens = np.random.default_rng(1).integers(0, 32, 16 * 8 + 1)
    x, y = tokens[:-1].reshape(16, 8), tokens[1:].reshape(16, 8)
    got = same_as_data_parallel(backend, "pipeline:2:2:1f1b", lambda: optax.sgd(0.05, 0.9),
                                gpt, x, y, steps=4)
    assert "opt/0.trace.tok_emb" in got


@pytest.mark.parametrize(("backend", "layout"), [("jax-pjit", "sharded:3"),
                                                 ("jax-pmap", "sharded:2")])
def test_a_native_flax_module_with_adamw(backend, layout):
    """A Flax module's own parameter tree: the moments under its paths, as data parallel."""
    import flax.linen as nn
    import jax

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3, name="out")(nn.relu(nn.Dense(7, name="hidden")(x)))

    x, y = data()
    x = x.astype(np.float32)
    module = Net()
    model = (module, module.init(jax.random.key(0), x[:1]))
    got = same_as_data_parallel(backend, layout, adamw, model, x, y, steps=6)
    assert "opt/0.mu.hidden.kernel" in got
