"""The decoder-only transformer of ``toolkit.GPT`` as a Flax (linen) module (see the contract in
``toolkit/models/gpt.py``: pre-LayerNorm blocks, tanh GELU, causal attention, optional tied head).

Parameter tree (``{"params": tree}`` is what ``FlaxGPT(spec).apply`` takes)::

    tok_emb                      (vocab, width)        a leaf at the top
    pos_emb                      (context, width)      a leaf at the top
    blocks_{i}/ln1/{scale,bias}
    blocks_{i}/attn/qkv/{kernel,bias}                  kernels (in, out), as nn.Dense's
    blocks_{i}/attn/proj/{kernel,bias}
    blocks_{i}/ln2/{scale,bias}
    blocks_{i}/mlp/fc/{kernel,bias}
    blocks_{i}/mlp/proj/{kernel,bias}
    ln_f/{scale,bias}
    head/kernel                  (width, vocab)        only when not tied

The path is the neutral name split at its dots, except that ``blocks.{i}`` is the one key
``blocks_{i}`` (Flax's own naming of a list of submodules). No other key has the form
``blocks_<digits>``, so ``path_of``/``name_of`` (and ``to_tree``/``from_tree``) invert each other
exactly, and the arrays are the neutral ones unchanged (no transposes).

dtype: the module computes in the dtype of the parameters it is given (``spec.init(seed,
"float64")`` runs in float64 when JAX has x64 enabled); ``param_dtype`` only matters for
``FlaxGPT(spec).init(...)`` (Flax's own initialisers, not GPT-2's: load ``spec.init`` instead).
"""

from __future__ import annotations

import math
import re
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from adapters._jax.models.layers import dense

_BLOCK = re.compile(r"blocks_(\d+)")


def path_of(name: str) -> tuple[str, ...]:
    """Neutral name -> tree path: ``blocks.0.attn.qkv.kernel`` -> ``("blocks_0", "attn", "qkv",
    "kernel")``; ``tok_emb`` -> ``("tok_emb",)``."""
    parts = name.split(".")
    if parts[0] == "blocks":
        return (f"blocks_{parts[1]}", *parts[2:])
    return tuple(parts)


def name_of(path: tuple[str, ...]) -> str:
    """Tree path -> neutral name (the inverse of :func:`path_of`)."""
    match = _BLOCK.fullmatch(path[0])
    head = [f"blocks.{match.group(1)}"] if match else [path[0]]
    return ".".join(head + list(path[1:]))


def to_tree(flat: dict[str, Any]) -> dict[str, Any]:
    """Neutral name -> array, to the nested parameter dict of :class:`FlaxGPT`."""
    tree: dict[str, Any] = {}
    for name, value in flat.items():
        *parents, leaf = path_of(name)
        node = tree
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return tree


def from_tree(tree: Any) -> dict[str, Any]:
    """The nested parameter dict of :class:`FlaxGPT` to neutral name -> array."""
    from flax import traverse_util

    return {name_of(path): v for path, v in traverse_util.flatten_dict(dict(tree)).items()}


class _LayerNorm(nn.Module):
    """(z - mean) / sqrt(var + 1e-5) * scale + bias, biased variance over the last axis."""

    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, z):
        width = z.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (width,), self.param_dtype)
        bias = self.param("bias", nn.initializers.zeros, (width,), self.param_dtype)
        return layer_norm(jnp, z, scale, bias)


def layer_norm(jnp, z, scale, bias):
    """The statistics and the normalisation in float32 (or wider: ``z``'s own dtype when it
    is), the result in ``z``'s dtype (mixed precision keeps them out of bfloat16)."""
    acc = jnp.promote_types(z.dtype, jnp.float32)
    zf = z.astype(acc)
    mean = jnp.mean(zf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(zf - mean), axis=-1, keepdims=True)
    return ((zf - mean) / jnp.sqrt(var + 1e-5) * scale.astype(acc)
            + bias.astype(acc)).astype(z.dtype)


def embed(jnp, tok_emb, pos_emb, x):
    """The token and position embeddings of ids ``x``, looked up and added in float32 (or
    wider), in the tables' dtype: the same values as in the tables' own dtype, but their
    gradients are gathered (a scatter-add over the batch's tokens) and summed over the batch,
    and under jax-pjit across devices, in float32 before they are rounded once."""
    acc = jnp.promote_types(tok_emb.dtype, jnp.float32)
    return (jnp.take(tok_emb.astype(acc), x, axis=0)
            + pos_emb[: x.shape[1]].astype(acc)).astype(tok_emb.dtype)


def tied_logits(jnp, f, tok_emb):
    """``f @ tok_emb.T`` over ``f``'s last axis, its products summed in float32 (or wider) and
    rounded once (the contract's dense layer, as :func:`dense`): the embedding's gradient from
    the head is then a float32 sum too."""
    acc = jnp.promote_types(f.dtype, jnp.float32)
    flat = f.reshape(-1, f.shape[-1])
    out = jnp.dot(flat, tok_emb.T, preferred_element_type=acc).astype(f.dtype)
    return out.reshape(*f.shape[:-1], tok_emb.shape[0])


def causal_softmax(jax, s, causal):
    """The attention weights of scores ``s``, computed in float32 (or wider), in ``s``'s
    dtype."""
    jnp = jax.numpy
    acc = jnp.promote_types(s.dtype, jnp.float32)
    return jax.nn.softmax(jnp.where(causal, s.astype(acc), -jnp.inf), axis=-1).astype(s.dtype)


class _Dense(nn.Module):
    """``z @ kernel (+ bias)`` as one 2-D matmul: XLA's CPU dots with (B, T) leading axes (and
    their transposed gradients) are slower than the flattened (B*T, in) @ (in, out); the
    parameters are nn.Dense's (``kernel`` (in, out), ``bias``)."""

    features: int
    use_bias: bool = True
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, z):
        init = nn.initializers.normal(0.02)
        kernel = self.param("kernel", init, (z.shape[-1], self.features), self.param_dtype)
        flat = z.reshape(-1, z.shape[-1])
        if self.use_bias:  # (rounded once: layers.dense)
            out = dense(jnp, flat, kernel, self.param("bias", nn.initializers.zeros,
                                                      (self.features,), self.param_dtype))
        else:
            out = flat @ kernel
        return out.reshape(*z.shape[:-1], self.features)


class _Attention(nn.Module):
    width: int
    heads: int
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, a):
        B, T, _ = a.shape
        dh = self.width // self.heads
        qkv = _Dense(3 * self.width, name="qkv", param_dtype=self.param_dtype)(a)
        # columns [q | k | v], head h at h*dh:(h+1)*dh of each -> 3 x (B, H, T, dh)
        q, k, v = jnp.transpose(qkv.reshape(B, T, 3, self.heads, dh), (2, 0, 3, 1, 4))
        s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(dh)
        causal = jnp.tril(jnp.ones((T, T), bool))  # key j <= query i
        p = causal_softmax(jax, s, causal)
        o = jnp.einsum("bhqk,bhkd->bqhd", p, v).reshape(B, T, self.width)  # heads concatenated
        return _Dense(self.width, name="proj", param_dtype=self.param_dtype)(o)


class _MLP(nn.Module):
    width: int
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, m):
        m = _Dense(4 * self.width, name="fc", param_dtype=self.param_dtype)(m)
        m = jax.nn.gelu(m, approximate=True)
        return _Dense(self.width, name="proj", param_dtype=self.param_dtype)(m)


class _Block(nn.Module):
    width: int
    heads: int
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, h):
        pd = self.param_dtype
        h = h + _Attention(self.width, self.heads, pd, name="attn")(_LayerNorm(pd, name="ln1")(h))
        return h + _MLP(self.width, pd, name="mlp")(_LayerNorm(pd, name="ln2")(h))


class FlaxGPT(nn.Module):
    """``FlaxGPT(spec)``: token ids ``(B, T)`` -> logits ``(B, T, vocab)``; ``recompute``:
    each block's activations recomputed in the backward pass (``nn.remat``)."""

    spec: Any
    param_dtype: Any = jnp.float32
    recompute: bool = False

    @nn.compact
    def __call__(self, x):
        spec, pd = self.spec, self.param_dtype
        init = nn.initializers.normal(0.02)
        tok_emb = self.param("tok_emb", init, (spec.vocab, spec.width), pd)
        pos_emb = self.param("pos_emb", init, (spec.context, spec.width), pd)
        h = embed(jnp, tok_emb, pos_emb, x)
        block = nn.remat(_Block) if self.recompute else _Block
        for i in range(spec.layers):
            h = block(spec.width, spec.heads, pd, name=f"blocks_{i}")(h)
        f = _LayerNorm(pd, name="ln_f")(h)
        if spec.tied:
            return tied_logits(jnp, f, tok_emb)  # (the lookup's leaf: its gradient sums both)
        return _Dense(spec.vocab, use_bias=False, name="head", param_dtype=pd)(f)

