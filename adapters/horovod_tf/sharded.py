"""ZeRO stages 1-3 / FSDP for ``horovod-tf``: the data-parallel strategy with the spec model's
parameters, gradients and optimizer state in flat per-unit shards (``flat_shards.py``:
``ShardedTF``, its compiled step and state). Spec models shard, with ``toolkit.SGD``/``Adam``
or an elementwise Keras optimizer."""

from __future__ import annotations

from typing import Any

import numpy as np

from adapters.horovod_tf.data_parallel import TFDataParallel
from adapters.horovod_tf.flat_shards import ShardedTF
from adapters.horovod_tf.keras_optim import check_elementwise, for_stage
from adapters.horovod_tf.models.keras_native import is_keras_optimizer
from toolkit import CNN, GPT, MLP, SGD, Adam, Sharded, ToolkitError


def check_shardable(backend: str, layout: Sharded, model: Any, optimizer: Any) -> None:
    """A ToolkitError unless ``model`` and ``optimizer`` are specs this backend can shard."""
    if not isinstance(model, MLP | CNN | GPT):
        raise ToolkitError(
            f"{backend} cannot shard a {type(model).__name__} under layout {layout.name!r}",
            "sharded layouts in horovod-tf take the spec models toolkit.MLP, toolkit.CNN and "
            "toolkit.GPT (split into flat per-unit shards); train a Keras model with the "
            "data-parallel layout")
    if is_keras_optimizer(optimizer):
        import keras

        check_elementwise(keras, optimizer, layout.name)
    elif not isinstance(optimizer, SGD | Adam):
        raise ToolkitError(
            f"{backend} cannot shard the optimizer {type(optimizer).__name__} under layout "
            f"{layout.name!r}", "pass toolkit.SGD(...) or toolkit.Adam(...) (their arithmetic "
            "runs on flat shards), or an elementwise Keras optimizer")


class TFSharded(TFDataParallel):
    """``toolkit.Sharded(stage)`` for ``horovod-tf`` (see :class:`toolkit.Adapter`)."""

    shards: ShardedTF
    compresses = False  # (its reductions are the flat shards')
    defers = False  # (its step reads the update's counters on the host: flat_shards.py)

    @staticmethod
    def check_layout(layout: Sharded) -> None:
        if layout.tensor_parallel > 1:
            raise ToolkitError(f"horovod-tf cannot run tensor_parallel={layout.tensor_parallel} "
                               f"(layout {layout.name!r})",
                               "only jax-pjit splits layers: use tensor_parallel=1 or --backend "
                               "jax-pjit")

    def build(self, model: Any, optimizer: Any, loss: Any, **options: Any) -> None:
        check_shardable("horovod-tf", self.layout, model, optimizer)
        super().build(model, optimizer, loss, **options)

    def _make_variables(self, model: Any, optimizer: Any, seed: int) -> None:
        """Rank 0's initial parameters, cut into this rank's shards (``ShardedTF``)."""
        keras_opt = for_stage(optimizer) if is_keras_optimizer(optimizer) else None
        self.shards = ShardedTF(self.runtime, self.layout, model, self.rule,
                                model.init(seed, self.runtime.dtype_name), self.local_grads,
                                keras_opt, self.precision, self.recompute)
        self.state.vars = self.shards.vars  # stages 1/2: the full parameters; 3: none
        self.state.keras_opt = keras_opt

    def _forward(self, x, training: bool):
        if self.shards.stage == 3:  # parameters gathered unit by unit
            return self.shards.forward(self.precision.in_compute(x))
        return super()._forward(x, training)

    def _step_fn(self, x, y, scalars, seeds):
        return self.shards.step_fn(x, y, scalars, seeds)

    def state_dict(self) -> dict[str, np.ndarray]:
        return {**self.shards.state_dict(), **self.state.counters()}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        self.shards.load_state_dict(state)
        self.rule.load(state)

    def sharded_state(self) -> tuple[dict, dict]:
        """``(replicated, pieces)`` (see ``toolkit.ShardedAdapter``)."""
        replicated, pieces = self.shards.sharded_state()
        return {**replicated, **self.state.counters()}, pieces

    def memory_bytes(self) -> dict[str, int]:
        return self.shards.memory_bytes()
