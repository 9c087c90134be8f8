"""The user's own Keras optimizer in ``horovod-tf``'s layouts, and its checkpoint names.

A pipeline stage updates only its own variables, a sharded layout only this rank's flat shard
of each unit, so each builds the user's optimizer over those: the optimizer object itself when
it is not built yet, else a fresh one of its class and settings (``from_config(get_config())``,
a ``LearningRateSchedule`` included). That is exact for an
*elementwise* optimizer, whose update of an element reads only that element's variable,
gradient and slots (and optimizer-wide scalars such as the iteration count, the same on every
stage): :data:`ELEMENTWISE` lists the ``keras.optimizers`` classes this holds for; any other
class, and the options that read a whole tensor or the whole gradient (``clipnorm``,
``global_clipnorm``), are refused with the reason.
"""

from __future__ import annotations

from typing import Any

from adapters._common import unique_names
from toolkit import ToolkitError
from toolkit.errors import describe

ELEMENTWISE = ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adamax", "Adadelta", "Nadam",
               "Lion", "Ftrl")
REFUSED = {
    "Lamb": "its trust ratio divides each tensor's norm by its update's",
    "Adafactor": "it factors each matrix's second moment into its row and column means",
    "Muon": "it orthogonalises each matrix's update",
    "LossScaleOptimizer": "it scales the loss itself: use precision='fp16-mixed'",
}
WORKS = ("keras.optimizers." + ", keras.optimizers.".join(ELEMENTWISE) + " (with any "
         "LearningRateSchedule), or toolkit.SGD/toolkit.Adam")


def check_elementwise(keras, optimizer: Any, layout: str) -> None:
    """A ToolkitError unless ``optimizer`` is a Keras optimizer a stage can run on its own
    variables exactly (its exact class: a subclass may change the update)."""
    name = type(optimizer).__name__
    if not (type(optimizer) is getattr(keras.optimizers, name, None) and name in ELEMENTWISE):
        why = REFUSED.get(name, "it is not one of the Keras optimizers known to update each "
                                "element from that element alone")
        raise ToolkitError(f"under a {layout} layout horovod-tf cannot use the optimizer "
                           f"{describe(optimizer)}: {why}", f"use one of {WORKS}; or the "
                           "data-parallel layout, where every rank holds whole tensors")
    for option in ("clipnorm", "global_clipnorm"):
        if getattr(optimizer, option, None) is not None:
            raise ToolkitError(
                f"under a {layout} layout horovod-tf cannot use the optimizer "
                f"{describe(optimizer)} with {option}={getattr(optimizer, option)}: it reads "
                "the norm of whole tensors, which a stage does not hold",
                "clip with Trainer(clip_grad_norm=...) (the norm over every stage), and "
                f"build the optimizer without {option}")


def named_slots(optimizer: Any, named: dict[str, Any]) -> dict[str, Any]:
    """A built Keras optimizer's variables by checkpoint name: ``opt/<slot>/<name>`` for the
    slot ``<slot>`` of the variable ``named[<name>]`` (Keras names it after the variable's
    ``path``, or a ``tf.Variable``'s ``name``), ``opt/<its name>`` for the others (``iteration``,
    ``learning_rate``)."""
    def prefix(var) -> str:
        if hasattr(var, "path"):
            return var.path.replace("/", "_") + "_"
        return str(var.name).replace("/", "_").replace(":", "_") + "_"

    prefixes = sorted(((prefix(v), n) for n, v in named.items()), key=lambda p: -len(p[0]))
    names = []
    for var in optimizer.variables:
        name = var.name
        for start, param in prefixes:
            if name.startswith(start) and len(name) > len(start):
                name = f"{name[len(start):]}/{param}"
                break
        names.append(f"opt/{name}")
    return dict(zip(unique_names(names), optimizer.variables, strict=True))


def for_stage(optimizer: Any) -> Any:
    """The optimizer a stage builds over its own variables: ``optimizer`` when it is not
    built yet, else a fresh one of its class and settings (weight-decay exclusions, which the
    settings do not carry, are refused)."""
    if not optimizer.built:
        return optimizer
    if getattr(optimizer, "_exclude_from_weight_decay", None) or getattr(
            optimizer, "_exclude_from_weight_decay_names", None):
        raise ToolkitError(
            f"the Keras optimizer {optimizer.name!r} was built before, with variables excluded "
            "from weight decay: a pipeline stage builds its own over its variables",
            "pass the optimizer unbuilt (exclude_from_weight_decay(var_names=...) works by name)")
    return type(optimizer).from_config(optimizer.get_config())
