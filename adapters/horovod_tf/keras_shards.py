"""A Keras 3 model under ``horovod-tf``'s sharded layouts (ZeRO stages 1-3 / FSDP): the units
``flat_shards.ShardedTF`` shards (:class:`KerasUnits`, a ``flat_shards.ShardUnits``).

The whole model is one unit, ``all``: its trainable variables, in ``model.trainable_variables``
order and under the neutral names data parallel saves them by (``models/keras_native.py``),
are one flat buffer padded to a multiple of the world size, so a checkpoint moves between
``data`` and every ``sharded:Z``.

- Stages 1 and 2: the model's own variables are the full parameters and the forward is data
  parallel's (``model(x, training=...)``: BatchNormalization's statistics, Dropout's seeded
  draws, the Keras dtype policy); ``ShardedTF`` reduces the gradient into shards, updates this
  rank's shard and assigns the all-gathered result back into the variables.
- Stage 3: the parameters live only as shards. The model's trainable variables give up their
  storage (:meth:`KerasUnits.release`); the forward is ``model.stateless_call`` on the
  gathered buffer inside ``ShardedTF``'s custom gradient, from the non-trainable values
  (statistics, seed-generator states) read once before it, so a recomputation in the backward
  draws the same Dropout masks and sees the same batch; the new values it returns are assigned
  to the model's non-trainable variables once, after the forward.

The buffer is gathered in the parameters' dtype also under mixed precision: the layers' Keras
policy casts each variable where the layer computes in the lower precision (as in data
parallel), and keeps float32 where it does not (BatchNormalization).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from adapters.horovod_tf.models.keras_native import KerasNative, assign, to_host
from toolkit import ToolkitError
from toolkit.parallel.shards import FlatLayout

UNIT = "all"  # (toolkit.parallel.shards.units_of's name for a model without numbered units)


class _Call(NamedTuple):
    """One stage-3 forward: its inputs, the non-trainable values before it, the training
    flag, and the non-trainable values each run of the model returned (the forward's first)."""

    x: Any
    before: list
    training: bool
    after: list


class KerasUnits:
    """A built Keras model (its :class:`~adapters.horovod_tf.models.keras_native.KerasNative`)
    as one sharding unit of its trainable variables (``flat_shards.ShardUnits``)."""

    compute_gather = False  # the layers' dtype policy casts each variable itself

    def __init__(self, tf: Any, keras_model: KerasNative, dtype: str):
        self.tf, self.native, self.model = tf, keras_model, keras_model.model
        wrong = {n: str(v.dtype) for n, v in keras_model.params.items() if str(v.dtype) != dtype}
        if wrong:
            name, kind = next(iter(wrong.items()))
            raise ToolkitError(
                f"horovod-tf cannot shard the Keras model {self.model.name!r}: its trainable "
                f"variable {name!r} is {kind}, and a sharded layout keeps every trainable "
                f"variable in one flat {dtype} buffer",
                f"make that variable non-trainable (layer.trainable = False) or {dtype}, or "
                "train the model with the data-parallel layout")
        self.names = list(keras_model.params)
        self.init = {n: to_host(v) for n, v in keras_model.params.items()}
        self.state = list(self.model.non_trainable_variables)  # stateless_call's order

    def layouts(self, world_size: int) -> dict[str, FlatLayout]:
        return {UNIT: FlatLayout.from_shapes({n: a.shape for n, a in self.init.items()},
                                             world_size)}

    def variables(self, values: dict[str, np.ndarray]) -> dict[str, Any]:
        """The model's own trainable variables, assigned ``values`` (rank 0's)."""
        for name, var in self.native.params.items():
            assign(var, values[name])
        return dict(self.native.params)

    def release(self) -> None:
        """Stage 3: each trainable variable's storage becomes an empty one: its values live in
        the shards only, and a call of the model outside the sharded forward fails on the
        shapes instead of computing with stale weights. (Keras keeps a TensorFlow variable's
        storage in ``_value``; its shape for the stateless call is its own ``shape``.)"""
        tf = self.tf
        for var in self.model.trainable_variables:
            var._value = tf.Variable(tf.zeros([0], var.dtype), trainable=False,
                                     name=f"{var.name}_released")

    def functions(self, count: int) -> list[tuple[Callable, tuple[int, ...]]]:
        del count  # (one unit)
        return [(self._call, (0,))]

    def forward(self, run: Callable[[Any], Any], x: Any, training: bool) -> Any:
        tf = self.tf
        call = _Call(x, [tf.convert_to_tensor(v) for v in self.state], training, [])
        out = run(call)
        for var, value in zip(self.state, call.after[0], strict=True):
            var.assign(value)
        return out

    def _call(self, params: dict, h: Any, call: _Call) -> Any:
        del h  # (the first and only unit reads the inputs)
        out, after = self.model.stateless_call([params[n] for n in self.names], call.before,
                                               call.x, training=call.training)
        call.after.append(after)
        return out
