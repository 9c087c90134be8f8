"""The TF family's one update path, inside the compiled step of every ``horovod-tf`` layout.

The layout supplies the reduced gradient and how to add up its squares (an allreduce across
ranks where each holds a shard); :func:`update` does the rest, once:

    unscale (fp16-mixed: the gradient of the scaled loss divided by the scale, exactly: a
    power of two) -> norm -> clip (``clip / max(norm, clip)``) -> apply -> the old state kept
    where the norm is not finite (``skip_nonfinite``, and always under a loss scaler: a skipped
    step changes no parameter, slot or statistic).

``apply`` is the layout's: a Keras optimizer's ``apply_gradients``, or the spec optimizers'
arithmetic (:func:`spec_update`, ``toolkit.models.reference.apply_update`` in TF ops, the same
as torch.optim and the float64 reference) on what this rank holds: named ``tf.Variable``\\ s
(:func:`apply_update`: data parallel, and each pipeline stage on its own variables) or flat
shards (``flat_shards.ShardedTF``). The host side (the spec's step count and scalars, the
step's ``StepResult``) is ``adapters._update.UpdateRule``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from adapters._update import Deferred, Report, StepScalars, advance
from toolkit import SGD
from toolkit.models.reference import optimizer_slots


def step_scalars(tf, scalars) -> StepScalars:
    """(in a step) The step's :class:`StepScalars` by name, of a plain vector or of
    :class:`Deferred` scalars (``Deferred.read``)."""
    if not isinstance(scalars, Deferred):
        return StepScalars.of(scalars)
    return scalars.read(lambda table, skips: tf.gather(table, tf.cast(skips, tf.int32)))


def update(tf, rule, grads: list, sum_squares: Callable[[list], Any],
           apply: Callable[[list], None], keep: list | tuple,
           scalars: Any) -> tuple[list, Any]:
    """Inside a compiled step: ``apply(grads)`` with the gradient clipped under ``rule``
    (``adapters._update.UpdateRule``: its ``clip`` and ``skip``). Under ``rule.skip`` a step
    whose norm is not finite applies nothing and assigns back each ``(variable, value)`` of
    ``keep`` (a BatchNorm statistic and its value before the forward pass moved it).

    Args:
        tf: the ``tensorflow`` module.
        rule: the build's ``UpdateRule``.
        grads: the reduced gradient (this rank's part of it, as the layout holds it).
        sum_squares: the sum of the squares of the whole gradient, given ``grads`` (the
            layout adds up its ranks' shares); called only when ``rule.needs_norm``.
        apply: the optimizer's update of what this rank holds, given the clipped ``grads``.
        keep: what a skipped step assigns back.
        scalars: the step's scalars (a vector or :class:`Deferred` ones); under a loss
            scaler the gradients are those of the loss times their loss scale. With
            :class:`Deferred` ones the norm's place holds the step's :class:`Report`, its
            counters advanced on the device.

    Returns:
        ``(clipped grads, norm)``: the norm before clipping (a zero unless
        ``rule.needs_norm``).
    """
    used = step_scalars(tf, scalars).loss_scale  # (the loss scale the gradients carry)
    scale = None if rule.scaler is None else used
    if scale is not None:
        grads = [g * tf.cast(1.0 / scale, g.dtype) for g in grads]
    grads, norm = clip_by_norm(tf, grads, sum_squares, rule.clip, rule.skip)
    if rule.skip:
        update_if_finite(tf, norm, lambda: apply(grads), keep)
    else:
        apply(grads)
    if not isinstance(scalars, Deferred):
        return grads, norm
    finite = tf.math.is_finite(norm)
    counters = advance(tf, rule.scaler, scalars.counters, finite)
    return grads, Report(norm, counters, tf.logical_not(finite), used)


def sum_squares(tf, grads: list) -> Any:
    """The sum of the squares of every element of ``grads``."""
    return tf.add_n([tf.reduce_sum(tf.square(g)) for g in grads])


def clip_by_norm(tf, grads: list, sum_sq: Callable[[list], Any], clip: float | None,
                 need_norm: bool = False):
    """``(grads scaled by clip / max(norm, clip), norm)`` for the whole gradient's
    ``sum_sq(grads)`` (``toolkit.models.reference.clip_scale``); ``clip`` None: ``grads`` as
    they are, and the norm only with ``need_norm`` (skipping non-finite steps), else a zero
    (the norm reads every gradient once more)."""
    if clip is None and not need_norm:
        return grads, tf.zeros(())
    norm = tf.sqrt(sum_sq(grads))
    if clip is None:
        return grads, norm
    scale = clip / tf.maximum(norm, clip)
    return [g * tf.cast(scale, g.dtype) for g in grads], norm


def update_if_finite(tf, norm, apply: Callable[[], None], keep: list | tuple) -> None:
    """Inside a compiled step: ``apply()`` when the gradient ``norm`` (the same on every rank,
    so every rank takes the same branch) is finite; otherwise each ``(variable, value)`` of
    ``keep`` is assigned back."""
    def skip():
        for variable, before in keep:
            variable.assign(before)

    tf.cond(tf.math.is_finite(norm), apply, skip)


def spec_update(tf, spec: Any, p, g, slots: dict, lr, step_size, c2_sqrt):
    """The parameter ``p`` (a tensor, or a variable read as one) after one step of the
    ``toolkit.SGD`` or ``toolkit.Adam`` ``spec`` with gradient ``g``; its ``slots`` (slot name
    -> variable: ``momentum``, or ``mu`` and ``nu``, as ``optimizer_slots`` names them) are
    assigned their new values. ``step_size`` and ``c2_sqrt`` are Adam's host-side scalars
    (``toolkit.models.reference.adam_scalars``). Elementwise, so a flat shard's zero padding
    stays zero."""
    if isinstance(spec, SGD):
        if spec.weight_decay:
            g = g + spec.weight_decay * p
        if spec.momentum:
            buf = spec.momentum * slots["momentum"] + g
            slots["momentum"].assign(buf)
            g = g + spec.momentum * buf if spec.nesterov else buf
        return p - lr * g
    if spec.decoupled:
        p = p * (1 - lr * spec.weight_decay)
    elif spec.weight_decay:
        g = g + spec.weight_decay * p
    m = spec.b1 * slots["mu"] + (1 - spec.b1) * g
    v = spec.b2 * slots["nu"] + (1 - spec.b2) * g * g
    slots["mu"].assign(m)
    slots["nu"].assign(v)
    return p - step_size * m / (tf.sqrt(v) / c2_sqrt + spec.eps)


def apply_update(tf, spec: Any, variables: dict, slots: dict, grads: dict,
                 scalars: StepScalars) -> None:
    """:func:`spec_update` of ``variables[name]`` (and its slots ``slots["opt/<slot>/<name>"]``)
    by ``grads[name]`` for every name of ``grads``, in that order, with the step's
    ``scalars``."""
    names = optimizer_slots(spec)
    for name, g in grads.items():
        p = variables[name]
        p.assign(spec_update(tf, spec, p, g, {s: slots[f"opt/{s}/{name}"] for s in names},
                             scalars.lr, scalars.step_size, scalars.c2_sqrt))
