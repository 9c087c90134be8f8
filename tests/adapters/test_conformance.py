"""The adapter contract, one suite for every implemented backend (not one copy per backend).

Single-process checks run in this process against a float64 numpy reference; the multi-rank
checks (broadcast from rank 0, collectives, identical updates) run under a real launcher (mpirun).
"""


import numpy as np
import pytest

import adapters
from toolkit import CNN, GPT, MLP, SGD, Adam, LaunchEnv, ToolkitError
from toolkit.models.reference import apply_update, init_state

BACKENDS = adapters.IMPLEMENTED
SPEC = MLP((8, 16, 4))
# Two convolutions, so that gradients flow through a convolution into another one.
CNN_SPEC = CNN(image_shape=(4, 4, 2), channels=(3, 2), classes=4)
# Two blocks, two heads, sequences shorter than the context; tied and untied heads.
GPT_SPEC = GPT(vocab=11, context=6, width=8, layers=2, heads=2)
GPT_UNTIED = GPT(vocab=11, context=6, width=8, layers=2, heads=2, tied=False)
ENV = LaunchEnv()


def data(n=12, seed=0, spec=SPEC):
    rng = np.random.default_rng(seed)
    if isinstance(spec, GPT):  # token ids in, next token ids out
        return (rng.integers(0, spec.vocab, size=(n, spec.context - 1)),
                rng.integers(0, spec.vocab, size=(n, spec.context - 1)))
    shape = (8,) if spec is SPEC else spec.image_shape
    return rng.normal(size=(n, *shape)), rng.integers(0, 4, size=n)


def built(name, optimizer, dtype="float64", accumulation_steps=1, seed=3, spec=SPEC):
    adapter = adapters.get(name, dtype=dtype)
    adapter.setup(ENV)
    adapter.build(spec, optimizer, "cross_entropy", seed=seed,
                  accumulation_steps=accumulation_steps)
    return adapter


def params_of(adapter):
    return {k[len("params/"):]: v for k, v in adapter.state_dict().items()
            if k.startswith("params/")}


@pytest.mark.parametrize("backend", BACKENDS)
def test_build_loads_the_spec_initialisation(backend):
    got = params_of(built(backend, SGD(lr=0.1)))
    want = SPEC.init(3, "float64")
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


OPTIMIZERS = {
    "sgd": SGD(lr=0.1),
    "sgd-momentum-wd": SGD(lr=0.1, momentum=0.9, weight_decay=0.01),
    "sgd-nesterov": SGD(lr=0.1, momentum=0.9, nesterov=True),
    "adam-l2": Adam(lr=0.01, weight_decay=0.1),
    "adamw": Adam(lr=0.01, weight_decay=0.1, decoupled=True),
}


# Every optimizer on the MLP and the CNN; the GPTs (slow to compile under JAX) with one SGD and
# two Adam variants between them: an optimizer's arithmetic is elementwise per parameter, the
# same code whatever the model, so the GPT's part is its forward and backward.
MODEL_OPTIMIZERS = [*((m, o) for m in ("mlp", "cnn") for o in OPTIMIZERS),
                    ("gpt", "sgd-momentum-wd"), ("gpt", "adamw"), ("gpt-untied", "adam-l2")]
SPECS = {"mlp": SPEC, "cnn": CNN_SPEC, "gpt": GPT_SPEC, "gpt-untied": GPT_UNTIED}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("model", "opt_name"), MODEL_OPTIMIZERS,
                         ids=[f"{m}-{o}" for m, o in MODEL_OPTIMIZERS])
def test_steps_match_the_numpy_reference(backend, model, opt_name):
    """The framework's model and optimizer arithmetic are the spec's and toolkit.models.reference's,
    to float64 rounding."""
    spec = SPECS[model]
    opt = OPTIMIZERS[opt_name]
    adapter = built(backend, opt, spec=spec)
    params = spec.init(3, "float64")
    state = init_state(opt, params)
    for step in range(4):
        x, y = data(seed=step, spec=spec)
        loss, grads = spec.loss_and_grads(params, x, y)
        assert float(adapter.train_step(x, y, 0.1 / (step + 1))) == pytest.approx(loss, rel=1e-12)
        params, state = apply_update(opt, params, grads, state, 0.1 / (step + 1))
    got = adapter.state_dict()
    expected = {**{f"params/{k}": v for k, v in params.items()}, **state}
    assert got.keys() == expected.keys()
    for k, v in expected.items():
        g = got[k]
        if isinstance(spec, GPT) and isinstance(opt, Adam) and k.endswith("attn.qkv.bias"):
            # The key bias does not change the output (softmax over keys is shift-invariant
            # per query): its gradient is exactly 0 plus rounding noise, which Adam's
            # normalisation turns into +-lr steps. Compare the query and value parts.
            width = spec.width
            g, v = np.delete(g, np.s_[width:2 * width]), np.delete(v, np.s_[width:2 * width])
        np.testing.assert_allclose(g, v, rtol=1e-10, atol=1e-12, err_msg=k)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec", [SPEC, CNN_SPEC], ids=["mlp", "cnn"])
def test_mse_loss_matches_the_numpy_reference(backend, spec):
    opt = SGD(lr=0.05, momentum=0.9)
    adapter = adapters.get(backend, dtype="float64")
    adapter.setup(ENV)
    adapter.build(spec, opt, "mse", seed=3)
    params = spec.init(3, "float64")
    state = init_state(opt, params)
    for step in range(3):
        x, _ = data(seed=step, spec=spec)
        y = np.random.default_rng(step).normal(size=(len(x), 4))
        loss, grads = spec.loss_and_grads(params, x, y, "mse")
        assert float(adapter.train_step(x, y, 0.05)) == pytest.approx(loss, rel=1e-12)
        params, state = apply_update(opt, params, grads, state, 0.05)
    result = adapter.evaluate(x, y)
    assert "correct" not in result
    assert result["loss_sum"] == pytest.approx(
        len(x) * np.mean((spec.apply(params, x) - y) ** 2), rel=1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradient_accumulation_equals_one_big_batch(backend):
    whole = built(backend, SGD(lr=0.1, momentum=0.9))
    split = built(backend, SGD(lr=0.1, momentum=0.9), accumulation_steps=4)
    for step in range(3):
        x, y = data(n=16, seed=step)
        expected = float(whole.train_step(x, y, 0.1))
        assert float(split.train_step(x, y, 0.1)) == pytest.approx(expected, rel=1e-12)
    a, b = params_of(whole), params_of(split)
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gpt_evaluation_is_token_level(backend):
    """loss_sum adds each sequence's mean token loss; correct its fraction of right tokens."""
    adapter = built(backend, SGD(lr=0.1), spec=GPT_SPEC)
    x, y = data(n=5, spec=GPT_SPEC)
    logits = GPT_SPEC.apply(GPT_SPEC.init(3, "float64"), x)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    token_losses = -np.take_along_axis(logp, y[..., None], axis=-1)[..., 0]
    result = adapter.evaluate(x, y)
    assert result["count"] == 5
    assert result["loss_sum"] == pytest.approx(token_losses.mean(1).sum(), rel=1e-10)
    assert result["correct"] == pytest.approx((logits.argmax(-1) == y).mean(1).sum(), rel=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_evaluate_returns_sums(backend):
    adapter = built(backend, SGD(lr=0.1))
    x, y = data(n=20)
    params = SPEC.init(3, "float64")
    loss, _ = SPEC.loss_and_grads(params, x, y)
    logits = SPEC.apply(params, x)
    result = adapter.evaluate(x, y)
    assert result["count"] == 20
    assert result["loss_sum"] == pytest.approx(20 * loss, rel=1e-12)
    assert result["correct"] == float((logits.argmax(1) == y).sum())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("optimizer", [SGD(lr=0.1, momentum=0.9), Adam(lr=0.01)])
def test_state_export_import_round_trip_continues_identically(backend, optimizer):
    a = built(backend, optimizer)
    for step in range(2):
        a.train_step(*data(seed=step), 0.05)
    saved = a.state_dict()
    assert all(isinstance(v, np.ndarray) for v in saved.values())
    assert any(k.startswith("opt/") for k in saved)
    b = built(backend, optimizer, seed=99)  # other initial weights, fresh optimizer
    b.load_state_dict(saved)
    for name, value in b.state_dict().items():
        np.testing.assert_array_equal(value, saved[name], err_msg=name)
    x, y = data(seed=7)
    assert float(a.train_step(x, y, 0.05)) == float(b.train_step(x, y, 0.05))
    for name, value in a.state_dict().items():
        np.testing.assert_array_equal(b.state_dict()[name], value, err_msg=name)


@pytest.mark.parametrize("backend", BACKENDS)
def test_collectives_on_one_rank_are_identities(backend):
    adapter = built(backend, SGD(lr=0.1))
    values = np.array([1.5, -2.0])
    np.testing.assert_array_equal(adapter.allreduce(values, "mean"), values)
    np.testing.assert_array_equal(adapter.allreduce(values, "sum"), values)
    np.testing.assert_array_equal(adapter.broadcast(values, 0), values)
    adapter.barrier()
    with pytest.raises(ToolkitError, match="unknown reduction 'max'"):
        adapter.allreduce(values, "max")


@pytest.mark.parametrize("backend", BACKENDS)
def test_unknown_model_and_optimizer_are_clear_errors(backend):
    adapter = adapters.get(backend)
    adapter.setup(ENV)
    with pytest.raises(ToolkitError, match="cannot build a model from dict"):
        adapter.build({"layers": 3}, SGD(lr=0.1), "cross_entropy")
    with pytest.raises(ToolkitError, match="cannot build an optimizer from 'lamb'"):
        adapter.build(SPEC, "lamb", "cross_entropy")


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_two_ranks_broadcast_reduce_and_update_identically(backend, launch):
    job = launch("any", 2, ["tests/scripts/conformance_worker.py", backend])
    assert job.returncode == 0, job
    results = sorted(job.results, key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1], job
    r0, r1 = results
    # Rank 1 initialised from another seed; after build it holds rank 0's weights, exactly.
    seed0 = SPEC.init(0, "float64")
    for r in results:
        assert r["initial"].keys() == seed0.keys()
        for k, v in seed0.items():
            np.testing.assert_array_equal(np.array(r["initial"][k]), v, err_msg=(r["rank"], k))
    assert r0["mean"] == r1["mean"] == [0.5, 5.0]
    assert r0["sum"] == r1["sum"] == [1.0, 10.0]
    assert r0["broadcast_from_1"] == r1["broadcast_from_1"] == [1.0]
    # Different local data, averaged gradients: the same update everywhere, and it equals
    # one process stepping on both halves together, tensor by tensor and element by element
    # (float64: the two differ only by the rounding of the mean of two half-batch means).
    assert r0["local_loss"] != r1["local_loss"]
    assert r0["after_step"].keys() == r1["after_step"].keys() == seed0.keys()
    for k in seed0:
        a0, a1 = np.array(r0["after_step"][k]), np.array(r1["after_step"][k])
        np.testing.assert_array_equal(a1, a0, err_msg=k)
        want = np.array(r0["single_process"][k])
        assert not np.array_equal(want, seed0[k]), k  # every tensor moves in this step
        np.testing.assert_allclose(a0, want, rtol=1e-12, atol=1e-14, err_msg=k)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["data", "sharded:3", "pipeline:1:2"])
def test_every_strategy_returns_a_step_result(backend, layout):
    """A step returns one StepResult: the loss, and the norm and skip only where the build asked
    for them (the Trainer reads nothing else of a step)."""
    from adapters._backend import StrategyBase
    from toolkit import StepResult, parse_layout
    from toolkit.models.reference import global_norm

    x, y = data()
    for options in ({}, {"clip_grad_norm": 1e9, "skip_nonfinite": True}):
        adapter = adapters.get(backend, dtype="float64")
        adapter.setup(ENV, parse_layout(layout))
        adapter.build(SPEC, SGD(lr=0.1), "cross_entropy", seed=3, **options)
        # every strategy answers what the Backend and the equivalence worker ask of it
        assert isinstance(adapter.strategy, StrategyBase), type(adapter.strategy)
        ranks, parts = adapter.strategy.data_split  # (a pipeline's parts: micro-batches)
        micro = getattr(adapter.strategy.layout, "micro_batches", 1)
        devices = adapter.strategy.runtime.local_device_count()
        assert ranks == 1 and parts in {1, devices, micro, devices * micro}
        assert 0 < adapter.strategy.part_weight <= 1
        before = {k: v for k, v in adapter.state_dict().items() if k.startswith("params/")}
        result = adapter.train_step(x, y, 0.1)
        assert isinstance(result, StepResult), type(result)
        assert np.isfinite(float(result)) and float(result) == float(result.loss)
        assert not result.skipped and result.loss_scale is None
        if not options:
            assert result.grad_norm is None
            continue
        params = {k[len("params/"):]: v for k, v in before.items()}
        _, grads = SPEC.loss_and_grads(params, x, y, "cross_entropy")
        assert float(result.grad_norm) == pytest.approx(global_norm(grads), rel=1e-10)
