"""Specs: seeded initialisation, schedules, and the numpy reference gradients."""

import math

import numpy as np
import pytest

from toolkit import CNN, MLP, SGD, ToolkitError, WarmupCosine, learning_rate, lr_scale


def test_init_is_seeded_and_shaped():
    a, b = MLP((64, 128, 10)).init(0), MLP((64, 128, 10)).init(0)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert a["layers.1.kernel"].shape == (128, 10) and a["layers.1.kernel"].dtype == np.float32
    assert not np.array_equal(a["layers.0.kernel"], MLP((64, 128, 10)).init(1)["layers.0.kernel"])
    assert np.abs(a["layers.0.kernel"]).max() <= 1 / 8


MODELS = {
    "mlp-relu": (MLP((5, 7, 3), "relu"), (5,)),
    "mlp-tanh": (MLP((5, 7, 3), "tanh"), (5,)),
    "cnn-two-convs": (CNN(image_shape=(4, 5, 2), channels=(3, 2), classes=3), (4, 5, 2)),
}


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
def test_reference_gradients_match_finite_differences(model, loss):
    spec, shape = MODELS[model]
    params = spec.init(1, "float64")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, *shape))
    y = rng.integers(0, 3, 6) if loss == "cross_entropy" else rng.normal(size=(6, 3))
    _, grads = spec.loss_and_grads(params, x, y, loss)
    for name in params:
        flat = params[name].reshape(-1)
        for i in range(0, flat.size, 3):
            old = flat[i]
            flat[i] = old + 1e-6
            up = spec.loss_and_grads(params, x, y, loss)[0]
            flat[i] = old - 1e-6
            down = spec.loss_and_grads(params, x, y, loss)[0]
            flat[i] = old
            assert grads[name].reshape(-1)[i] == pytest.approx((up - down) / 2e-6, abs=1e-7), name


def test_cnn_forward_is_a_same_padded_convolution():
    spec = CNN(image_shape=(3, 3, 1), channels=(1,), classes=1)
    params = {"convs.0.kernel": np.zeros((3, 3, 1, 1)), "convs.0.bias": np.zeros(1),
              "head.kernel": np.zeros((9, 1)), "head.bias": np.zeros(1)}
    params["convs.0.kernel"][1, 1, 0, 0] = 2.0  # centre tap: doubles the image
    params["convs.0.kernel"][0, 1, 0, 0] = 1.0  # tap above: adds the pixel one row up
    params["head.kernel"][4, 0] = 1.0  # read the centre pixel of the map
    x = np.arange(9.0).reshape(1, 3, 3, 1)
    assert spec.apply(params, x)[0, 0] == 2 * 4 + 1


def test_warmup_cosine():
    s = WarmupCosine(peak=1.0, warmup_steps=4, total_steps=14, end=0.1)
    assert [s(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s(9) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 2)))
    assert s(14) == pytest.approx(0.1) and s(100) == pytest.approx(0.1)
    assert learning_rate(SGD(lr=s), 2) == 0.75 and learning_rate(SGD(lr=0.3), 99) == 0.3


def test_lr_scaling():
    assert (lr_scale("none", 4), lr_scale("linear", 4), lr_scale("sqrt", 4)) == (1, 4, 2)
    with pytest.raises(ToolkitError, match="unknown lr scaling 'log'"):
        lr_scale("log", 4)


@pytest.mark.parametrize("sizes, activation", [((64,), "relu"), ((64, 0, 10), "relu"),
                                               ((64, 10), "swish")])
def test_bad_specs(sizes, activation):
    with pytest.raises(ToolkitError):
        MLP(sizes, activation)
