"""The spec optimizers' update (``toolkit.models.reference.apply_update``) in TF ops, on named
``tf.Variable``\\ s: ``horovod-tf``'s data-parallel step applies it to the whole model, its
pipeline stages (``_tf_pipeline.py``) each to their own variables, so both do the same
arithmetic as torch.optim and the float64 reference."""

from __future__ import annotations

from typing import Any

from toolkit import SGD


def apply_update(tf, spec: Any, variables: dict, slots: dict, grads: dict, lr, step_size,
                 c2_sqrt) -> None:
    """Updates ``variables[name]`` (and its slots ``slots["opt/<slot>/<name>"]``) by
    ``grads[name]`` for every name of ``grads``, in that order, under the ``toolkit.SGD`` or
    ``toolkit.Adam`` ``spec``; ``step_size`` and ``c2_sqrt`` are Adam's host-side scalars
    (``toolkit.models.reference.adam_scalars``)."""
    for name, g in grads.items():
        p = variables[name]
        if isinstance(spec, SGD):
            if spec.weight_decay:
                g = g + spec.weight_decay * p
            if spec.momentum:
                buf = slots[f"opt/momentum/{name}"]
                buf.assign(spec.momentum * buf + g)
                g = g + spec.momentum * buf if spec.nesterov else buf
            p.assign_sub(lr * g)
            continue
        if spec.decoupled:
            p.assign(p * (1 - lr * spec.weight_decay))
        elif spec.weight_decay:
            g = g + spec.weight_decay * p
        m, v = slots[f"opt/mu/{name}"], slots[f"opt/nu/{name}"]
        m.assign(spec.b1 * m + (1 - spec.b1) * g)
        v.assign(spec.b2 * v + (1 - spec.b2) * g * g)
        p.assign_sub(step_size * m / (tf.sqrt(v) / c2_sqrt + spec.eps))
