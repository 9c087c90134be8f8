"""The dense layer every Flax model of the specs computes (``spec.py``'s MLP and CNN,
``gpt.py``'s GPT, ``flat_units.unit_forward``), in a module of its own so that neither model
module imports the other for it. Imports no framework: the caller hands in ``jax.numpy``."""

from __future__ import annotations


def dense(jnp, h, kernel, bias):
    """``h @ kernel + bias`` rounded once to ``h``'s dtype: the products summed and the bias
    added in float32 (or wider), the mixed-precision contract's dense layer (docs/precision.md);
    for float32 or float64 inputs, the plain arithmetic."""
    acc = jnp.promote_types(h.dtype, jnp.float32)
    return (jnp.dot(h, kernel, preferred_element_type=acc) + bias.astype(acc)).astype(h.dtype)
