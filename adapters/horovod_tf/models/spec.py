"""The forward pass of the toolkit's MLP, CNN and GPT specs in TensorFlow ops, over variables
under the spec's neutral names (built from its numpy initialisation); with ``recompute``, each
GPT block and each hidden MLP layer under ``tf.recompute_grad`` (activation checkpointing: it
keeps its input and recomputes its insides in the backward pass)."""

from __future__ import annotations

from typing import Any

from adapters.horovod_tf.models.gpt import gpt_forward
from adapters.horovod_tf.models.layers import checkpointed, conv, matmul
from toolkit import CNN, GPT


def cnn_conv(tf, v: dict[str, Any], i: int, h):
    """The CNN's convolution ``i`` and its ReLU."""
    return tf.nn.relu(conv(tf, h, v[f"convs.{i}.kernel"], v[f"convs.{i}.bias"]))


def cnn_head(tf, v: dict[str, Any], h):
    """The CNN's head on its last convolution's output."""
    return matmul(tf, tf.reshape(h, [tf.shape(h)[0], -1]), v["head.kernel"],
                  bias=v["head.bias"])


def spec_forward(tf, spec: Any, v: dict[str, Any], x, recompute: bool = False):
    """``spec``'s outputs for inputs ``x`` with parameters ``v`` (neutral name -> variable);
    ``recompute``: activation checkpointing (the GPT's blocks, the MLP's hidden layers)."""
    if isinstance(spec, GPT):
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
