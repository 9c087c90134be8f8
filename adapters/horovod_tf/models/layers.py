"""TensorFlow's dense layer, convolution and activation checkpointing as the toolkit's
contract has them: each product rounded once (docs/precision.md), a recomputed unit's
parameters its arguments. The spec models (``spec.py``) and the GPT (``gpt.py``) are both built
on these, so neither imports the other for them."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any

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
    two 16-bit values is exact in float32) and one rounding: slower than TensorFlow's fused
    bfloat16 kernel, so only where that kernel would round otherwise."""
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


def checkpointed(tf, fn, v: dict[str, Any], names: list[str]):
    """``h -> fn(params, h)`` whose activations are recomputed in the backward pass
    (``tf.recompute_grad``); the parameters ``names`` of ``v`` are its arguments, so their
    gradients come back whether they are variables or (mixed precision) their casts."""
    @tf.recompute_grad
    def run(h, *params):
        return fn(dict(zip(names, params, strict=True)), h)

    return lambda h: run(h, *[v[n] for n in names])
