"""The forward of each sharding unit of a spec model in TensorFlow: the data-parallel forward
(``models/spec.py``) cut at the units of ``toolkit.parallel.shards.units_of`` (an MLP's layers, a
CNN's convolutions, a GPT's embeddings, blocks and head), used by the sharded layout
(``flat_shards.py``) and by the pipeline's stages (``stages.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from adapters.horovod_tf.models.gpt import _dense, _layer_norm, _lookup, run_block
from adapters.horovod_tf.models.layers import matmul
from adapters.horovod_tf.models.spec import cnn_conv, cnn_head, mlp_layer
from toolkit import CNN, GPT, MLP


def unit_functions(tf, spec: Any, count: int,
                   recompute: bool = False) -> list[tuple[Callable, tuple[int, ...]]]:
    """Per unit of ``toolkit.parallel.shards.units_of`` (``count`` of them):
    ``fn(params, h, x) -> h`` and the units whose parameters it reads (a tied GPT's last unit
    also reads the first unit's ``tok_emb``). The first unit reads ``x``; the last returns the
    model's output. ``recompute``: a GPT unit's block and an MLP's hidden layer under
    ``tf.recompute_grad``, as the data-parallel forward runs them (``models/spec.py``)."""
    if isinstance(spec, GPT):
        return [(_gpt_unit(tf, spec, i, recompute),
                 (i, 0) if spec.tied and 0 < i == count - 1 else (i,)) for i in range(count)]
    if isinstance(spec, CNN):
        return [(_cnn_unit(tf, spec, i, i == count - 1), (i,)) for i in range(count)]
    return [(_mlp_unit(tf, spec, i, recompute), (i,)) for i in range(count)]


def _mlp_unit(tf, spec: MLP, i: int, recompute: bool) -> Callable:
    def fn(v, h, x):  # the data-parallel forward's layer i
        return mlp_layer(tf, spec, v, i, x if h is None else h, recompute)

    return fn


def _cnn_unit(tf, spec: CNN, i: int, last: bool) -> Callable:
    def fn(v, h, x):  # the data-parallel forward's conv i (and the head in the last unit)
        h = x if h is None else h
        if i < len(spec.channels):
            h = cnn_conv(tf, v, i, h)
        return cnn_head(tf, v, h) if last else h

    return fn


def _gpt_unit(tf, spec: GPT, i: int, recompute: bool) -> Callable:
    """Block ``i`` of ``models/gpt.gpt_forward`` (the same ops in the same order), with the
    embeddings before block 0 and ``ln_f``/``head`` after the last block."""
    first, last = i == 0, i == spec.layers - 1

    def fn(v, h, x):
        B, T = tf.shape(x)[0], tf.shape(x)[1]
        if first:
            h = _lookup(tf, v["tok_emb"], x) + v["pos_emb"][:T]
        causal = tf.linalg.band_part(tf.ones([T, T], tf.bool), -1, 0)  # key j <= query i
        h = run_block(tf, spec, v, i, h, causal, recompute)
        if not last:
            return h
        f = _layer_norm(tf, v, "ln_f", h)
        if spec.tied:
            flat = matmul(tf, tf.reshape(f, [-1, spec.width]), v["tok_emb"], transpose_b=True)
            return tf.reshape(flat, [B, T, spec.vocab])
        return _dense(tf, v, "head", f)

    return fn
