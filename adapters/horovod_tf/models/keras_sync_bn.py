"""Keras 3 BatchNormalization with statistics over the global batch, on Horovod's allreduce.

Keras's BatchNormalization computes ``mean, variance = self._moments(inputs, mask)`` in
training (its ``synchronized=True`` relies on a ``tf.distribute`` strategy, not Horovod).
:func:`convert_sync_batchnorm` replaces ``_moments`` on each BatchNormalization layer of a
model, in place, by global moments: an allreduce-sum of the local sums and counts gives the
mean, a second one of the squared deviations from it the (biased) variance, as Keras uses it.
``horovod.tensorflow``'s allreduce is differentiable (its gradient is an allreduce-sum of the
incoming gradients), which is what makes the step exact: each rank's inputs receive every
rank's loss gradient through the shared statistics, and averaging the parameter gradients
over the ranks gives the gradient of the global-batch loss. Everything else (moving
statistics, renorm, gamma/beta) is Keras's own code; on one rank the layer is unchanged.
"""

from __future__ import annotations

from typing import Any


def global_moments(tf, hvd, inputs, mask, axes):
    """Mean and biased variance of ``inputs`` over ``axes`` and over every rank's batch."""
    keep = [1 if i in axes else -1 for i in range(len(inputs.shape))]
    if mask is None:
        weights = None
        shape = tf.shape(inputs)
        local_count = tf.cast(tf.reduce_prod(tf.gather(shape, axes)), inputs.dtype)
        local_sum = tf.reduce_sum(inputs, axes)
    else:  # the mask has one axis less than the inputs (no channel axis)
        weights = tf.broadcast_to(tf.cast(tf.expand_dims(mask, -1), inputs.dtype),
                                  tf.shape(inputs))
        local_count = tf.reduce_sum(weights, axes)
        local_sum = tf.reduce_sum(inputs * weights, axes)
    count = hvd.allreduce(local_count, op=hvd.Sum)
    mean = hvd.allreduce(local_sum, op=hvd.Sum) / count
    centred = inputs - tf.reshape(mean, [d if d == -1 else 1 for d in keep])
    squares = tf.square(centred) if weights is None else tf.square(centred) * weights
    variance = hvd.allreduce(tf.reduce_sum(squares, axes), op=hvd.Sum) / count
    return mean, variance


def convert_sync_batchnorm(keras, tf, hvd, model: Any) -> int:
    """Makes every BatchNormalization layer of ``model`` compute global statistics (in place;
    the layer objects and their variables stay the same). Returns how many were converted."""
    converted = 0
    for layer in model._flatten_layers(include_self=True, recursive=True):
        if not isinstance(layer, keras.layers.BatchNormalization):
            continue
        if getattr(layer, "_toolkit_sync_bn", False):
            converted += 1
            continue
        local = layer._moments

        def moments(inputs, mask, layer=layer, local=local):
            if hvd.size() == 1:  # exactly Keras's BatchNormalization
                return local(inputs, mask)
            return global_moments(tf, hvd, inputs, mask, list(layer._reduction_axes))

        # object.__setattr__: not state for Keras's attribute tracking.
        object.__setattr__(layer, "_moments", moments)
        object.__setattr__(layer, "_toolkit_sync_bn", True)
        converted += 1
    return converted
