"""The numpy reference optimizers against the formulas written out by hand."""

import numpy as np
import pytest

from toolkit import SGD, Adam
from toolkit._reference import apply_update, init_state


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
