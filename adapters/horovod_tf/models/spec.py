"""The forward pass of the toolkit's MLP, CNN and GPT specs in TensorFlow ops, over variables
under the spec's neutral names (built from its numpy initialisation); with ``recompute``, each
GPT block and each hidden MLP layer under ``tf.recompute_grad`` (activation checkpointing: it
keeps its input and recomputes its insides in the backward pass)."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any

from toolkit import CNN, GPT

_FLOAT32_PRODUCTS = contextvars.ContextVar("float32_products", default=False)


@contextlib.contextmanager
def float32_products():
    """Within it, :func:`matmul` and :func:`conv` build bfloat16 products in float32 too: for
    forwards TensorFlow's graph optimizer cannot fuse (a custom gradient, an XLA cluster)."""
    token = _FLOAT32_PRODUCTS.set(True)
    try:
        yield
    finally:
        _FLOAT32_PRODUCTS.reset(token)


def _native(tf, dtype) -> bool:
    """Whether TensorFlow's own kernel computes a product of ``dtype`` as the contract does:
    float32 and float64; bfloat16 where the graph optimizer fuses the bias into the product
    (a ``tf.function``'s data-parallel forward on a CPU: one oneDNN kernel, one rounding), not
    inside :func:`float32_products`; never float16 (Eigen's kernel on a CPU rounds otherwise)."""
    return dtype.size >= 4 or dtype == tf.bfloat16 and not _FLOAT32_PRODUCTS.get()


def matmul(tf, a, b, transpose_b: bool = False, bias=None):
    """``a @ b (+ bias)`` rounded once to ``a``'s dtype, the mixed-precision contract's product
    (docs/precision.md). For 16-bit operands TensorFlow's own kernel where it rounds once
    (:func:`_native`), else the products and their sum with the bias in float32 (a product of
    two 16-bit values is exact in float32) and one rounding: 1.5x the time of TensorFlow's
    fused bfloat16 kernel on an AVX512-BF16 CPU, so only where needed."""
    return _rounded_once(tf, lambda a, b: tf.matmul(a, b, transpose_b=transpose_b), a, b,
                         bias)


def conv(tf, h, kernel, bias):
    """``conv2d(h, kernel) + bias`` ("SAME", stride 1), rounded once as :func:`matmul`."""
    return _rounded_once(tf, lambda h, k: tf.nn.conv2d(h, k, 1, "SAME"), h, kernel, bias)


def _rounded_once(tf, product, a, b, bias):
    """``product(a, b) (+ bias)`` in ``a``'s dtype: TensorFlow's own kernel where it rounds
    once (:func:`_native`), else in float32 and rounded once."""
    if _native(tf, a.dtype):
        out = product(a, b)
        return out if bias is None else out + bias
    f32 = tf.float32
    wide = product(tf.cast(a, f32), tf.cast(b, f32))
    return tf.cast(wide if bias is None else wide + tf.cast(bias, f32), a.dtype)


def cnn_conv(tf, v: dict[str, Any], i: int, h):
    """The CNN's convolution ``i`` and its ReLU."""
    return tf.nn.relu(conv(tf, h, v[f"convs.{i}.kernel"], v[f"convs.{i}.bias"]))


def cnn_head(tf, v: dict[str, Any], h):
    """The CNN's head on its last convolution's output."""
    return matmul(tf, tf.reshape(h, [tf.shape(h)[0], -1]), v["head.kernel"],
                  bias=v["head.bias"])


def checkpointed(tf, fn, v: dict[str, Any], names: list[str]):
    """``h -> fn(params, h)`` whose activations are recomputed in the backward pass
    (``tf.recompute_grad``); the parameters ``names`` of ``v`` are its arguments, so their
    gradients come back whether they are variables or (mixed precision) their casts."""
    @tf.recompute_grad
    def run(h, *params):
        return fn(dict(zip(names, params, strict=True)), h)

    return lambda h: run(h, *[v[n] for n in names])


def spec_forward(tf, spec: Any, v: dict[str, Any], x, recompute: bool = False):
    """``spec``'s outputs for inputs ``x`` with parameters ``v`` (neutral name -> variable);
    ``recompute``: activation checkpointing (the GPT's blocks, the MLP's hidden layers)."""
    if isinstance(spec, GPT):
        from adapters.horovod_tf.models.gpt import gpt_forward

        return gpt_forward(tf, spec, v, x, recompute)
    if isinstance(spec, CNN):
        for i in range(len(spec.channels)):
            x = cnn_conv(tf, v, i, x)
        return cnn_head(tf, v, x)
    for i in range(spec.num_layers):
        x = mlp_layer(tf, spec, v, i, x, recompute)
    return x


def mlp_layer(tf, spec: Any, v: dict[str, Any], i: int, h, recompute: bool = False):
    """The MLP's layer ``i`` on ``h`` (a hidden layer with its activation); with ``recompute``, a
    hidden layer under ``tf.recompute_grad`` (``checkpointed``; the last layer never is). The
    data-parallel forward and the pipeline's and ZeRO's units (``models/units.py``) run it."""
    def layer(p, h):
        h = matmul(tf, h, p[f"layers.{i}.kernel"], bias=p[f"layers.{i}.bias"])
        if i < spec.num_layers - 1:
            h = tf.nn.relu(h) if spec.activation == "relu" else tf.tanh(h)
        return h

    if not (recompute and i < spec.num_layers - 1):
        return layer(v, h)
    return checkpointed(tf, layer, v, [f"layers.{i}.kernel", f"layers.{i}.bias"])(h)
