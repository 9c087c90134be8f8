"""The forward pass of the toolkit's MLP, CNN and GPT specs in TensorFlow ops, over variables
under the spec's neutral names (built from its numpy initialisation); with ``recompute``, each
GPT block and each hidden MLP layer under ``tf.recompute_grad`` (activation checkpointing: it
keeps its input and recomputes its insides in the backward pass)."""

from __future__ import annotations

from typing import Any

from toolkit import CNN, GPT


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
            x = tf.nn.relu(tf.nn.conv2d(x, v[f"convs.{i}.kernel"], 1, "SAME")
                           + v[f"convs.{i}.bias"])
        return tf.matmul(tf.reshape(x, [tf.shape(x)[0], -1]), v["head.kernel"]) + v["head.bias"]
    for i in range(spec.num_layers):
        x = mlp_layer(tf, spec, v, i, x, recompute)
    return x


def mlp_layer(tf, spec: Any, v: dict[str, Any], i: int, h, recompute: bool = False):
    """The MLP's layer ``i`` on ``h`` (a hidden layer with its activation); with ``recompute``, a
    hidden layer under ``tf.recompute_grad`` (``checkpointed``; the last layer never is). The
    data-parallel forward and the pipeline's and ZeRO's units (``models/units.py``) run it."""
    def layer(p, h):
        h = tf.matmul(h, p[f"layers.{i}.kernel"]) + p[f"layers.{i}.bias"]
        if i < spec.num_layers - 1:
            h = tf.nn.relu(h) if spec.activation == "relu" else tf.tanh(h)
        return h

    if not (recompute and i < spec.num_layers - 1):
        return layer(v, h)
    return checkpointed(tf, layer, v, [f"layers.{i}.kernel", f"layers.{i}.bias"])(h)
