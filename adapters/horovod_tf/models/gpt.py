"""The decoder-only transformer of ``toolkit.GPT`` in plain TensorFlow ops (see the contract in
``toolkit/models/gpt.py``: pre-LayerNorm blocks, tanh GELU, causal attention, optional tied head).

Layout choice: the TF backend keeps its variables in a dict neutral name -> ``tf.Variable`` in
the neutral layout (kernels (in, out), ``y = x @ kernel + bias``), so the forward pass reads them
by name and nothing is converted on import or export.

Gradients are dense for every variable. The embedding lookup is a ``tf.gather`` whose gradient
TF would return as ``tf.IndexedSlices`` (which Horovod allreduces by allgather, and which does
not add to a dense tensor in the step's accumulation loop); ``_lookup`` instead gives the table a
dense gradient, summed per row with ``tf.math.unsorted_segment_sum`` (deterministic on CPU). The
tied head reads the same ``tok_emb`` variable, so the tape sums both uses.

GELU is written out (``_gelu``) rather than ``tf.nn.gelu(approximate=True)``, which is about
1e-9 off in float64 (its 0.044715 goes through float32); the two agree in float32. Dense layers
are flattened to 2-D matmuls: one GEMM, where TF's broadcasting batched matmul of a 3-D input by a
2-D kernel is slower on CPU.

Works eagerly, inside ``tf.function`` (T may be dynamic: it is read with ``tf.shape``) and under
``tf.GradientTape``; the arithmetic runs in the variables' dtype (float32 or float64).
"""

from __future__ import annotations

import math

from adapters.horovod_tf.models.layers import checkpointed, matmul


def _lookup(tf, table, ids):
    """``table[ids]`` whose gradient w.r.t. ``table`` is a dense tensor, not IndexedSlices."""

    @tf.custom_gradient
    def gather(table):
        def grad(dy):  # each row's sum over the tokens that looked it up
            return tf.math.unsorted_segment_sum(tf.reshape(dy, [-1, tf.shape(table)[-1]]),
                                                tf.reshape(ids, [-1]), tf.shape(table)[0])

        return tf.gather(table, ids), grad

    return gather(tf.convert_to_tensor(table))


def _wide(tf, z):
    """``z`` in float32 when it is 16-bit (mixed precision), else as it is."""
    return tf.cast(z, tf.float32) if z.dtype in (tf.bfloat16, tf.float16) else z


def _layer_norm(tf, v, name, z):
    """(z - mean) / sqrt(var + 1e-5) * scale + bias over the last axis (biased variance); the
    statistics and the normalisation in float32 under mixed precision, the result in ``z``'s
    dtype."""
    zf = _wide(tf, z)
    mean, var = tf.nn.moments(zf, axes=[-1], keepdims=True)
    out = ((zf - mean) * tf.math.rsqrt(var + 1e-5) * tf.cast(v[f"{name}.scale"], zf.dtype)
           + tf.cast(v[f"{name}.bias"], zf.dtype))
    return tf.cast(out, z.dtype)


def causal_softmax(tf, s, causal):
    """The attention weights of scores ``s`` (``-inf`` where ``causal`` is False), computed in
    float32 under mixed precision, in ``s``'s dtype."""
    sf = _wide(tf, s)
    p = tf.nn.softmax(tf.where(causal, sf, tf.constant(float("-inf"), sf.dtype)), axis=-1)
    return tf.cast(p, s.dtype)


def _gelu(tf, z):
    """GPT-2's tanh GELU. Not ``tf.nn.gelu(approximate=True)``: that casts its 0.044715 through
    float32 (``math_ops.cast`` of a Python float), about 1e-9 off in float64; here every
    constant is made in z's dtype. In float32 the two are the same function."""
    c = tf.constant(math.sqrt(2.0 / math.pi), z.dtype)
    k = tf.constant(0.044715, z.dtype)
    return 0.5 * z * (1.0 + tf.tanh(c * (z + k * z * z * z)))


def _dense(tf, v, name, z):
    """z @ kernel + bias as one 2-D matmul (TF's batched matmul of (B, T, in) by a 2-D kernel
    is slower on CPU than the flattened one)."""
    kernel = v[f"{name}.kernel"]
    flat = matmul(tf, tf.reshape(z, [-1, tf.shape(kernel)[0]]), kernel,
                  bias=v.get(f"{name}.bias"))
    return tf.reshape(flat, tf.concat([tf.shape(z)[:-1], tf.shape(kernel)[1:]], 0))


def _block(tf, spec, v, b: str, h, causal):
    """Block ``b`` (its parameters ``v[f"{b}.*"]``) on the residual stream ``h``."""
    heads, dh = spec.heads, spec.width // spec.heads
    B, T = tf.shape(h)[0], tf.shape(h)[1]
    qkv = _dense(tf, v, f"{b}.attn.qkv", _layer_norm(tf, v, f"{b}.ln1", h))
    # columns [q | k | v], head h at h*dh:(h+1)*dh of each -> 3 x (B, H, T, dh)
    q, k, val = tf.unstack(tf.transpose(tf.reshape(qkv, [B, T, 3, heads, dh]),
                                        [2, 0, 3, 1, 4]))
    s = matmul(tf, q, k, transpose_b=True) / tf.constant(math.sqrt(dh), h.dtype)
    p = causal_softmax(tf, s, causal)
    o = tf.reshape(tf.transpose(matmul(tf, p, val), [0, 2, 1, 3]), [B, T, spec.width])
    h = h + _dense(tf, v, f"{b}.attn.proj", o)
    m = _dense(tf, v, f"{b}.mlp.fc", _layer_norm(tf, v, f"{b}.ln2", h))
    return h + _dense(tf, v, f"{b}.mlp.proj", _gelu(tf, m))


def run_block(tf, spec, v, i: int, h, causal, recompute: bool = False):
    """Block ``i`` on the residual stream ``h``; with ``recompute``, under ``tf.recompute_grad``
    (``models/layers.checkpointed``, the block's parameters its arguments). The data-parallel
    forward and the pipeline's and ZeRO's units (``models/units.py``) run their blocks here."""
    b = f"blocks.{i}"

    def block(p, h):
        return _block(tf, spec, p, b, h, causal)

    if not recompute:
        return block(v, h)
    return checkpointed(tf, block, v, [n for n in v if n.startswith(f"{b}.")])(h)


def gpt_forward(tf, spec, variables, x, recompute: bool = False):
    """Logits ``(B, T, vocab)`` of the ``toolkit.GPT`` spec for token ids ``x`` ``(B, T)``.

    Args:
        tf: the tensorflow module.
        spec: the ``toolkit.GPT`` spec (its sizes and ``tied``).
        variables: neutral name -> ``tf.Variable`` (or tensor), in the neutral layout.
        x: integer token ids, shape ``(B, T)`` with ``T <= spec.context``.
        recompute: each block under ``tf.recompute_grad`` (``run_block``).
    """
    v = variables
    x = tf.convert_to_tensor(x)
    if x.dtype not in (tf.int32, tf.int64):
        x = tf.cast(x, tf.int64)
    B, T = tf.shape(x)[0], tf.shape(x)[1]
    h = _lookup(tf, v["tok_emb"], x) + v["pos_emb"][:T]
    causal = tf.linalg.band_part(tf.ones([T, T], tf.bool), -1, 0)  # key j <= query i
    for i in range(spec.layers):
        h = run_block(tf, spec, v, i, h, causal, recompute)
    f = _layer_norm(tf, v, "ln_f", h)
    if spec.tied:  # the same variable as the lookup
        flat = matmul(tf, tf.reshape(f, [-1, spec.width]), v["tok_emb"], transpose_b=True)
        return tf.reshape(flat, [B, T, spec.vocab])
    return _dense(tf, v, "head", f)
