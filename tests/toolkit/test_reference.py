"""The numpy reference optimizers against the formulas written out by hand."""

import numpy as np
import pytest

from toolkit import SGD, Adam
from toolkit.models.reference import apply_update, init_state


def run(spec, steps=3):
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(3, 2))}
    grads = [{"w": rng.normal(size=(3, 2))} for _ in range(steps)]
    state = init_state(spec, params)
    for g in grads:
        params, state = apply_update(spec, params, g, state, 0.1)
    return params["w"], state, grads, rng


def test_sgd_momentum_nesterov_weight_decay():
    spec = SGD(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)
    got, state, grads, _ = run(spec)
    p = np.random.default_rng(0).normal(size=(3, 2))
    buf = np.zeros_like(p)
    for g in grads:
        g = g["w"] + 0.01 * p
        buf = 0.9 * buf + g
        p = p - 0.1 * (g + 0.9 * buf)
    np.testing.assert_allclose(got, p, rtol=1e-15)
    np.testing.assert_allclose(state["opt/momentum/w"], buf, rtol=1e-15)


@pytest.mark.parametrize("decoupled", [False, True])
def test_adam_and_adamw(decoupled):
    spec = Adam(lr=0.1, weight_decay=0.1, decoupled=decoupled)
    got, state, grads, _ = run(spec)
    p = np.random.default_rng(0).normal(size=(3, 2))
    m = v = np.zeros_like(p)
    for t, g in enumerate(grads, 1):
        g = g["w"] if decoupled else g["w"] + 0.1 * p
        if decoupled:
            p = p * (1 - 0.1 * 0.1)
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        m_hat, v_hat = m / (1 - 0.9 ** t), v / (1 - 0.999 ** t)
        p = p - 0.1 * m_hat / (np.sqrt(v_hat) + 1e-8)
    np.testing.assert_allclose(got, p, rtol=1e-12)
    assert int(state["opt/count"]) == 3


def test_plain_sgd_has_no_state():
    assert init_state(SGD(lr=1.0), {"w": np.zeros(2)}) == {}


def test_sgd_momentum_without_nesterov():
    spec = SGD(lr=0.1, momentum=0.9)
    got, state, grads, _ = run(spec)
    p = np.random.default_rng(0).normal(size=(3, 2))
    buf = np.zeros_like(p)
    for g in grads:
        buf = 0.9 * buf + g["w"]
        p = p - 0.1 * buf
    np.testing.assert_allclose(got, p, rtol=1e-15)
    np.testing.assert_allclose(state["opt/momentum/w"], buf, rtol=1e-15)


@pytest.mark.parametrize("spec, slots", [(SGD(lr=1.0, momentum=0.9), ["momentum"]),
                                         (Adam(lr=1.0), ["mu", "nu"])])
def test_the_state_holds_a_zero_array_per_slot_and_parameter(spec, slots):
    params = {"w": np.ones((3, 2), np.float32), "b": np.ones(2, np.float64)}
    state = init_state(spec, params)
    for slot in slots:
        for name, p in params.items():
            held = state[f"opt/{slot}/{name}"]
            assert held.shape == p.shape and held.dtype == p.dtype and not held.any()


def test_reference_run_is_sequential_training_on_the_samplers_global_batches():
    """One process, one update per global batch of the sampler's documented order, the step's
    learning rate; runs across epochs until ``steps`` updates."""
    from toolkit.data.sampler import GlobalBatchSampler
    from toolkit.models.reference import reference_run
    from toolkit.models.specs import MLP, WarmupCosine, learning_rate

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(20, 3)), rng.integers(0, 2, 20)
    model = MLP((3, 5, 2))
    spec = SGD(lr=WarmupCosine(peak=0.5, warmup_steps=2, total_steps=5), momentum=0.9)
    losses, params = reference_run(model, spec, "cross_entropy", x, y, global_batch_size=8,
                                   steps=5, seed=3)
    sampler = GlobalBatchSampler(20, 8, seed=3)  # 2 global batches per epoch
    p, want = model.init(3, "float64"), []
    state = init_state(spec, p)
    for step in range(5):
        idx = sampler.global_batch(step // 2, step % 2)
        value, grads = model.loss_and_grads(p, x[idx], y[idx], "cross_entropy")
        p, state = apply_update(spec, p, grads, state, learning_rate(spec, step))
        want.append(value)
    assert losses == want
    for name in p:
        assert params[name].dtype == np.float64
        np.testing.assert_array_equal(params[name], p[name])
    # in float32 the data and the parameters are float32; the same steps, to float32 precision
    losses32, params32 = reference_run(model, spec, "cross_entropy", x, y, global_batch_size=8,
                                       steps=5, seed=3, dtype="float32")
    np.testing.assert_allclose(losses32, want, rtol=1e-5)
    for name in p:
        assert params32[name].dtype == np.float32
        np.testing.assert_allclose(params32[name], p[name], rtol=1e-4, atol=1e-6)


class _Recorder:
    """A model that records the inputs and the loss name it is given."""

    def __init__(self):
        self.seen = []

    def init(self, seed, dtype):
        return {"w": np.zeros(1, dtype)}

    def loss_and_grads(self, params, x, y, loss):
        self.seen.append((x.dtype, loss))
        return 0.0, {"w": np.zeros(1, params["w"].dtype)}


def test_reference_run_casts_float_data_keeps_token_ids_and_passes_the_loss():
    from toolkit.models.reference import reference_run

    for x, dtype, expected in [(np.ones((8, 2)), "float32", np.float32),
                               (np.ones((8, 2), np.float32), "float64", np.float64),
                               (np.arange(16).reshape(8, 2), "float32", np.int64)]:
        model = _Recorder()
        reference_run(model, SGD(lr=0.1), "mse", x, np.zeros(8), global_batch_size=4, steps=3,
                      dtype=dtype)
        assert model.seen == [(np.dtype(expected), "mse")] * 3


def test_reference_run_seeds_with_0_by_default():
    from toolkit.models.reference import reference_run
    from toolkit.models.specs import MLP

    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(16, 3)), rng.integers(0, 2, 16)
    args = (MLP((3, 4, 2)), SGD(lr=0.1), "cross_entropy", x, y)
    default = reference_run(*args, global_batch_size=4, steps=3)
    assert default[0] == reference_run(*args, global_batch_size=4, steps=3, seed=0)[0]
    assert default[0] != reference_run(*args, global_batch_size=4, steps=3, seed=1)[0]
