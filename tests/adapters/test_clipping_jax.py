"""Gradient clipping by global norm in the JAX backends, every layout, against the float64
numpy reference (``toolkit.models.reference``): the same norms before clipping, the same
losses and parameters, with a bound small enough that most steps clip.

In this process (2 CPU devices, conftest): data parallel, ZeRO 1-3 and tensor parallelism
over the two devices, and two pipeline stages (a tied GPT: its embedding counted once).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import adapters
import toolkit
from toolkit.equivalence import load_data, make_model
from toolkit.models.reference import reference_run

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "scripts"))
from pipeline_jax_worker import attach  # noqa: E402

STEPS, BATCH, CLIP = 6, 32, 0.5
BACKENDS = ("jax-pmap", "jax-pjit")
OPTIMIZERS = {"sgd": lambda: toolkit.SGD(lr=0.5, momentum=0.9),
              "adamw": lambda: toolkit.Adam(lr=3e-3, weight_decay=0.1, decoupled=True)}


def reference(model_name, optimizer, clip):
    x, y = load_data(model_name, "float64")
    norms: list[float] = []
    losses, params = reference_run(make_model(model_name), optimizer, "cross_entropy", x, y,
                                   global_batch_size=BATCH, steps=STEPS, seed=0,
                                   clip_grad_norm=clip, norms=norms)
    return np.asarray(losses), params, np.asarray(norms)


def clipped_run(backend, layout, model_name, optimizer):
    adapter = adapters.get(backend, dtype="float64")
    if layout.startswith("pipeline"):  # two stages in this one process
        adapter.setup(toolkit.current_env())
        attach(adapter, toolkit.parse_layout(layout), samples="process")
        layout = None
    x, y = load_data(model_name, "float64")
    trainer = toolkit.Trainer(adapter, make_model(model_name), optimizer, layout=layout,
                              global_batch_size=BATCH, max_steps=STEPS, seed=0, progress=False,
                              clip_grad_norm=CLIP)
    history = trainer.fit(x, y)
    return history, adapter.state_dict()


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("backend, layout, model_name", [
    *[(b, layout, "mlp") for b in BACKENDS
      for layout in ("data", "sharded:1", "sharded:2", "sharded:3", "pipeline:2:4:1f1b")],
    ("jax-pjit", "sharded:3:tp2", "gpt"),
    ("jax-pjit", "pipeline:2:4:1f1b", "gpt"),
    ("jax-pmap", "pipeline:2:4:gpipe", "gpt"),
])
def test_clipped_training_equals_the_reference(backend, layout, model_name, opt):
    ref_losses, ref_params, ref_norms = reference(model_name, OPTIMIZERS[opt](), CLIP)
    history, state = clipped_run(backend, layout, model_name, OPTIMIZERS[opt]())
    # the bound acts on most steps, and changes the run
    assert np.mean(ref_norms > CLIP) >= 0.5, ref_norms
    free_losses, _, _ = reference(model_name, OPTIMIZERS[opt](), None)
    assert np.max(np.abs(free_losses - ref_losses)) > 1e-4
    norms, losses = np.asarray(history.grad_norms), np.asarray(history.losses)
    assert norms.shape == ref_norms.shape == (STEPS,)
    assert np.max(np.abs(norms - ref_norms) / ref_norms) < 1e-10, (norms, ref_norms)
    assert np.max(np.abs(losses - ref_losses) / ref_losses) < 1e-10, (losses, ref_losses)
    for name, value in ref_params.items():
        assert np.max(np.abs(state[f"params/{name}"] - value)) < 1e-10, name


@pytest.mark.parametrize("clip", [None, 1e9])
def test_the_norm_is_logged_when_clipping_and_the_bound_is_checked(tmp_path, clip):
    """A bound no step reaches leaves the run as it is and logs every norm; without a bound
    no norm is computed (it would cost every step a reduction over the gradient)."""
    adapter = adapters.get("jax-pjit", dtype="float64")
    x, y = load_data("mlp", "float64")
    log = tmp_path / "metrics.jsonl"
    trainer = toolkit.Trainer(adapter, make_model("mlp"), toolkit.SGD(lr=0.5), max_steps=4,
                              global_batch_size=BATCH, progress=False, metrics_log=log,
                              clip_grad_norm=clip)
    history = trainer.fit(x, y)
    ref_losses, _, ref_norms = reference("mlp", toolkit.SGD(lr=0.5), None)
    assert np.allclose(history.losses, ref_losses[:4], rtol=1e-10, atol=0)
    import json

    steps = [json.loads(line) for line in log.read_text().splitlines()]
    logged = [r.get("grad_norm") for r in steps if r["event"] == "step"]
    if clip is None:
        assert history.grad_norms == [] and logged == [None] * 4
    else:
        assert np.allclose(history.grad_norms, ref_norms[:4], rtol=1e-10, atol=0)
        assert logged == history.grad_norms
    for bad in (0, -1.0, float("nan"), "1", True):
        with pytest.raises(toolkit.ToolkitError, match="is not a positive number"):
            toolkit.Trainer(adapter, make_model("mlp"), toolkit.SGD(lr=0.5),
                            global_batch_size=BATCH, clip_grad_norm=bad)
