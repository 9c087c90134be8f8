"""The forward pass of the toolkit's MLP, CNN and GPT specs in TensorFlow ops, over variables
under the spec's neutral names (built from its numpy initialisation)."""

from __future__ import annotations

from typing import Any

from toolkit import CNN, GPT


def spec_forward(tf, spec: Any, v: dict[str, Any], x):
    """``spec``'s outputs for inputs ``x`` with parameters ``v`` (neutral name -> variable)."""
    if isinstance(spec, GPT):
        from adapters.horovod_tf.models.gpt import gpt_forward

        return gpt_forward(tf, spec, v, x)
    if isinstance(spec, CNN):
        for i in range(len(spec.channels)):
            x = tf.nn.relu(tf.nn.conv2d(x, v[f"convs.{i}.kernel"], 1, "SAME")
                           + v[f"convs.{i}.bias"])
        return tf.matmul(tf.reshape(x, [tf.shape(x)[0], -1]), v["head.kernel"]) + v["head.bias"]
    for i in range(spec.num_layers):
        x = tf.matmul(x, v[f"layers.{i}.kernel"]) + v[f"layers.{i}.bias"]
        if i < spec.num_layers - 1:
            x = tf.nn.relu(x) if spec.activation == "relu" else tf.tanh(x)
    return x
