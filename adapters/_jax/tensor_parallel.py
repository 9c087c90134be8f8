"""Tensor parallelism of the GPT for jax-pjit (Megatron style, over the mesh's ``model`` axis).

Each block's attention and MLP are split over ``k`` devices: the fused ``qkv`` kernel (and bias)
by heads (a column split of each of q, k and v), the attention output projection by rows (the
same heads), ``mlp.fc`` by columns and ``mlp.proj`` by rows. A device then computes its heads and
its quarter of the hidden units locally; the row-split projections yield partial sums that the
compiler adds with one all-reduce over ``model`` per sub-layer (two per block), as in Megatron.

A split kernel is kept in a *view* whose leading axis is the split one (heads for attention,
hidden units for the MLP), so that ``view.reshape(k, -1)`` puts device ``r``'s part in row ``r``:

- ``attn.qkv.kernel`` ``(w, 3w)`` -> ``(H, w, 3, dh)``; its bias ``(3w,)`` -> ``(H, 3, dh)``
- ``attn.proj.kernel`` ``(w, w)`` -> ``(H, dh, w)`` (its rows are the heads concatenated)
- ``mlp.fc.kernel`` ``(w, 4w)`` -> ``(4w, w)`` (transposed); ``mlp.fc.bias`` and
  ``mlp.proj.kernel`` ``(4w, w)`` unchanged.

:func:`forward` computes exactly the function of ``adapters._jax.models.gpt.FlaxGPT`` from
these views.
"""

from __future__ import annotations

import math
from typing import Any

from toolkit import ToolkitError

SPLIT = ("attn.qkv.kernel", "attn.qkv.bias", "attn.proj.kernel", "mlp.fc.kernel",
         "mlp.fc.bias", "mlp.proj.kernel")


def split_names(spec: Any) -> tuple[str, ...]:
    """The neutral names of the GPT's tensors that tensor parallelism splits."""
    return tuple(f"blocks.{i}.{s}" for i in range(spec.layers) for s in SPLIT)


def check(spec: Any, k: int, devices: int, native: bool) -> None:
    """Clear errors for a tensor-parallel size the model or the devices cannot take."""
    from toolkit.models.gpt import GPT

    if native or not isinstance(spec, GPT):
        raise ToolkitError(
            f"jax-pjit: tensor_parallel={k} splits the attention and MLP kernels of a "
            f"toolkit.GPT, not of {type(spec).__name__}",
            "use tensor_parallel=1 (sharding over data alone) for this model, or a toolkit.GPT")
    if devices % k:
        raise ToolkitError(f"jax-pjit: tensor_parallel={k} does not divide the {devices} "
                           "devices", f"use a divisor of {devices}, or change --local-devices "
                           "/ the number of processes")
    if spec.heads % k:
        raise ToolkitError(f"jax-pjit: tensor_parallel={k} does not divide the GPT's "
                           f"{spec.heads} heads", f"use a divisor of {spec.heads}")


def to_view(name: str, a: Any, spec: Any, xp: Any) -> Any:
    """A split tensor in its original layout -> its view (``xp`` is numpy or jax.numpy)."""
    w, h = spec.width, spec.heads
    dh = w // h
    if name.endswith("attn.qkv.kernel"):
        return xp.transpose(a.reshape(w, 3, h, dh), (2, 0, 1, 3))
    if name.endswith("attn.qkv.bias"):
        return xp.transpose(a.reshape(3, h, dh), (1, 0, 2))
    if name.endswith("attn.proj.kernel"):
        return a.reshape(h, dh, w)
    if name.endswith("mlp.fc.kernel"):
        return xp.transpose(a)
    return a


def from_view(name: str, v: Any, spec: Any, xp: Any) -> Any:
    """The inverse of :func:`to_view`."""
    w = spec.width
    if name.endswith("attn.qkv.kernel"):
        return xp.transpose(v, (1, 2, 0, 3)).reshape(w, 3 * w)
    if name.endswith("attn.qkv.bias"):
        return xp.transpose(v, (1, 0, 2)).reshape(3 * w)
    if name.endswith("attn.proj.kernel"):
        return v.reshape(w, w)
    if name.endswith("mlp.fc.kernel"):
        return xp.transpose(v)
    return v


def products(jax, constrain, mixed: bool):
    """``product(equation, a, kernel, accumulate)``: ``einsum(equation, a, kernel)`` of an
    activation and a split kernel (its leading axis over ``model``).

    ``accumulate``: the products summed in float32 (the column-split kernels, computed locally:
    the contract's dense layer, rounded once by the caller after the bias); else in the
    operands' dtype (the row-split projections: each device's partial sum is rounded and the
    all-reduce over ``model`` carries 16 bits, as in Megatron).

    Under mixed precision (``mixed``) a custom gradient keeps the collectives as Megatron has
    them and the kernel gradients in float32 across devices: the activation's gradient is a
    16-bit product (the column-split input's partial sums all-reduced over ``model`` in 16
    bits); the kernel's is summed in float32 and pinned to the kernel's sharding (replicated
    over ``data``) before it is rounded, so its sum over the batch's shards crosses devices in
    float32 and is rounded once (the compiler would otherwise sum 16-bit partial gradients)."""
    jnp = jax.numpy

    def product(equation: str, a, kernel, accumulate: bool):
        acc = jnp.promote_types(a.dtype, jnp.float32) if accumulate else None
        if not mixed:
            return jnp.einsum(equation, a, kernel, preferred_element_type=acc)
        inputs, out = equation.split("->")
        lhs, rhs = inputs.split(",")
        dims = ("model",) + (None,) * (kernel.ndim - 1)

        @jax.custom_vjp
        def run(a, kernel):
            return jnp.einsum(equation, a, kernel, preferred_element_type=acc)

        def backward(saved, ct):
            a, kernel = saved
            ct = ct.astype(a.dtype)  # (exact: the caller rounded the output)
            dk = jnp.einsum(f"{lhs},{out}->{rhs}", a, ct, preferred_element_type=jnp.float32)
            return (jnp.einsum(f"{out},{rhs}->{lhs}", ct, kernel),
                    constrain(dk, dims).astype(kernel.dtype))

        run.defvjp(lambda a, kernel: (run(a, kernel), (a, kernel)), backward)
        return run(a, kernel)
    return product


def forward(p: dict[str, Any], x: Any, spec: Any, constrain: Any, recompute: bool = False
            ) -> Any:
    """Logits ``(B, T, vocab)`` of token ids ``x`` from parameters ``p`` (neutral names, split
    tensors as views). ``constrain(array, dims)`` pins an activation's sharding: ``dims`` names a
    mesh axis (``data``, ``model``) or None per dimension; ``recompute``: each block's
    activations recomputed in the backward pass (``jax.checkpoint``)."""
    import jax
    import jax.numpy as jnp

    from adapters._jax.models.gpt import causal_softmax, embed, layer_norm, tied_logits

    B, T = x.shape
    dh = spec.width // spec.heads
    h = embed(jnp, p["tok_emb"], p["pos_emb"], x)
    causal = jnp.tril(jnp.ones((T, T), bool))
    acc = jnp.promote_types(h.dtype, jnp.float32)
    product = products(jax, constrain, h.dtype != acc)

    def dense_out(out, bias):  # a row-split product's sum, plus its bias: rounded once
        out = constrain(out, ("data", None, None))  # (the 16-bit all-reduce, then the bias)
        return (out.astype(acc) + bias.astype(acc)).astype(h.dtype)

    def block(h, b):  # one block, ``b`` its names' prefix
        a = layer_norm(jnp, h, p[b + "ln1.scale"], p[b + "ln1.bias"])
        # (3, B, H, T, dh): heads sharded over "model", each device's heads computed locally
        qkv = product("btw,hwcd->cbhtd", a, p[b + "attn.qkv.kernel"], True)
        qkv = qkv + jnp.transpose(p[b + "attn.qkv.bias"], (1, 0, 2))[:, None, :, None, :]
        qkv = constrain(qkv.astype(a.dtype), (None, "data", "model", None, None))
        q, k, v = qkv[0], qkv[1], qkv[2]
        s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(dh)
        att = causal_softmax(jax, s, causal)
        o = jnp.einsum("bhqk,bhkd->bqhd", att, v)
        # row-split projection: partial sums over each device's heads, all-reduced over "model"
        out = product("bqhd,hdw->bqw", o, p[b + "attn.proj.kernel"], False)
        h = constrain(h + dense_out(out, p[b + "attn.proj.bias"]), ("data", None, None))
        m = layer_norm(jnp, h, p[b + "ln2.scale"], p[b + "ln2.bias"])
        f = product("btw,fw->btf", m, p[b + "mlp.fc.kernel"], True)
        f = (f + p[b + "mlp.fc.bias"]).astype(m.dtype)
        f = constrain(jax.nn.gelu(f, approximate=True), ("data", None, "model"))
        out = product("btf,fw->btw", f, p[b + "mlp.proj.kernel"], False)
        h = constrain(h + dense_out(out, p[b + "mlp.proj.bias"]), ("data", None, None))
        return h

    run = jax.checkpoint(block, static_argnums=(1,)) if recompute else block
    for i in range(spec.layers):
        h = run(h, f"blocks.{i}.")
    f = layer_norm(jnp, h, p["ln_f.scale"], p["ln_f.bias"])
    if spec.tied:
        return tied_logits(jnp, f, p["tok_emb"])
    return (f.reshape(-1, spec.width) @ p["head.kernel"]).reshape(B, T, -1)
