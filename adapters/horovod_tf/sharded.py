"""ZeRO stages 1-3 / FSDP for ``horovod-tf``: the data-parallel strategy with the model's
parameters, gradients and optimizer state in flat per-unit shards (``flat_shards.py``:
``ShardedTF``, its compiled step and state). Spec models shard unit by unit
(``flat_shards.SpecUnits``); a built Keras 3 model as one unit (``keras_shards.KerasUnits``),
with its BatchNormalization statistics and Dropout seeds handled as data parallel handles them.
The optimizer is ``toolkit.SGD``/``Adam`` or an elementwise Keras optimizer."""

from __future__ import annotations

from typing import Any

import numpy as np

from adapters.horovod_tf.data_parallel import TFDataParallel
from adapters.horovod_tf.flat_shards import ShardedTF, SpecUnits
from adapters.horovod_tf.keras_optim import check_elementwise, for_stage
from adapters.horovod_tf.models.keras_native import KerasNative, assign, is_keras_optimizer, to_host
from toolkit import CNN, GPT, MLP, SGD, Adam, Sharded, ToolkitError
from toolkit.errors import describe


def _is_keras_model(model: Any) -> bool:
    try:
        import keras
    except ImportError:
        return False
    return isinstance(model, keras.Layer)


def check_shardable(backend: str, layout: Sharded, model: Any, optimizer: Any) -> None:
    """A ToolkitError unless this backend can shard ``model`` (a spec or a Keras model) with
    ``optimizer``."""
    if not isinstance(model, MLP | CNN | GPT) and not _is_keras_model(model):
        raise ToolkitError(
            f"{backend} cannot shard a {type(model).__name__} under layout {layout.name!r}",
            "sharded layouts in horovod-tf take the spec models toolkit.MLP, toolkit.CNN and "
            "toolkit.GPT, or a built Keras 3 model (keras.Model, Sequential or functional)")
    if is_keras_optimizer(optimizer):
        import keras

        check_elementwise(keras, optimizer, layout.name)
        if any(getattr(optimizer, f"_exclude_from_weight_decay{kind}", None)
               for kind in ("", "_pattern", "_names")):  # (by variable, by name: Keras 3)
            raise ToolkitError(
                f"under a {layout.name} layout horovod-tf cannot use {describe(optimizer)} "
                "with variables excluded from weight decay: it updates one flat shard per "
                "unit, which holds many variables, so it cannot tell them apart by name",
                "decay every variable, or use the data-parallel layout")
    elif not isinstance(optimizer, SGD | Adam):
        raise ToolkitError(
            f"{backend} cannot shard the optimizer {type(optimizer).__name__} under layout "
            f"{layout.name!r}", "pass toolkit.SGD(...) or toolkit.Adam(...) (their arithmetic "
            "runs on flat shards), or an elementwise Keras optimizer")


class TFSharded(TFDataParallel):
    """``toolkit.Sharded(stage)`` for ``horovod-tf`` (see :class:`toolkit.Adapter`)."""

    shards: ShardedTF
    compresses = False  # (its reductions are the flat shards')
    composes = ("replicate",)  # HSDP: the shards' group a node's ranks, replicas across

    @staticmethod
    def check_layout(layout: Any) -> None:
        if layout.dims.tensor > 1:
            raise ToolkitError(f"horovod-tf cannot run tensor_parallel={layout.dims.tensor} "
                               f"(layout {layout.name!r})",
                               "only jax-pjit splits layers: use tensor_parallel=1 or --backend "
                               "jax-pjit")

    def build(self, model: Any, optimizer: Any, loss: Any, **options: Any) -> None:
        check_shardable("horovod-tf", self.layout, model, optimizer)
        super().build(model, optimizer, loss, **options)

    def _make_variables(self, model: Any, optimizer: Any, seed: int) -> None:
        """Rank 0's initial parameters, cut into this rank's shards (``ShardedTF``); a Keras
        model's non-trainable variables (BatchNorm statistics) rank 0's too."""
        if self.native:
            from adapters.horovod_tf.keras_shards import KerasUnits

            self.keras_model = KerasNative(model, self.runtime.dtype_name, "horovod-tf",
                                           self.precision)
            if self.sync_batchnorm:
                from adapters.horovod_tf.models.keras_sync_bn import convert_sync_batchnorm

                convert_sync_batchnorm(self.keras_model.keras, self.tf, self.hvd, model)
            units = KerasUnits(self.tf, self.keras_model, self.runtime.dtype_name)
            self.state.buffers = self.keras_model.buffers
            for var in self.state.buffers.values():
                var.assign(self.hvd.broadcast(self.tf.convert_to_tensor(var), root_rank=0))
        else:
            units = SpecUnits(self.tf, model, model.init(seed, self.runtime.dtype_name))
        keras_opt = for_stage(optimizer) if is_keras_optimizer(optimizer) else None
        self.shards = ShardedTF(self.runtime, self.layout, units, self.rule, self.local_grads,
                                keras_opt, self.precision, self.recompute)
        self.state.vars = self.shards.vars  # stages 1/2: the full parameters; 3: none
        self.state.keras_opt = keras_opt

    def _forward(self, x, training: bool):
        if self.shards.stage == 3:  # parameters gathered unit by unit
            return self.shards.forward(x if self.native else self.precision.in_compute(x),
                                       training)
        return super()._forward(x, training)

    def _step_fn(self, x, y, scalars, seeds):
        tf = self.tf
        if self.native:
            self.keras_model.reseed(seeds)
        # a skipped step leaves the statistics as they were, as data parallel's
        kept = ([(b, tf.identity(b)) for b in self.state.buffers.values()]
                if self.rule.skip else [])
        return self.shards.step_fn(x, y, scalars, kept)

    def _buffers(self) -> dict[str, np.ndarray]:
        return {f"buffers/{n}": to_host(v) for n, v in self.state.buffers.items()}

    def state_dict(self) -> dict[str, np.ndarray]:
        return {**self.shards.state_dict(), **self._buffers(), **self.state.counters()}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        self.shards.load_state_dict(state)
        for name, var in self.state.buffers.items():
            assign(var, state[f"buffers/{name}"])
        self.rule.load(state)
        if self.native:
            self.state.steps = int(state["rng/step"])

    def sharded_state(self) -> tuple[dict, dict]:
        """``(replicated, pieces)`` (see ``toolkit.ShardedAdapter``)."""
        replicated, pieces = self.shards.sharded_state()
        return {**replicated, **self._buffers(), **self.state.counters()}, pieces

    def memory_bytes(self) -> dict[str, int]:
        return self.shards.memory_bytes()
