"""ZeRO stages 1-3 / FSDP for ``horovod-torch``: the data-parallel step with the model's
parameters, gradients and optimizer state in flat per-unit shards (``flat_shards.py``:
``ShardedParameters``, which re-routes the module's parameters to its buffers) in the place of
Horovod's ``DistributedOptimizer``, through the same update path (``update.py``); the spec
optimizer's step count is the strategy's ``UpdateRule``'s (``opt/count``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from adapters.horovod_torch.data_parallel import TorchDataParallel
from adapters.horovod_torch.flat_shards import ShardedParameters, native_units, spec_units
from adapters.horovod_torch.models.spec import same, to_host
from adapters.horovod_torch.ops import make_optimizer
from adapters.horovod_torch.scheduler import load_scheduler_state, scheduler_state
from adapters.horovod_torch.torch_optim import check_elementwise
from adapters.horovod_torch.update import step_scalars, takes_found_inf, update
from toolkit import SGD, Adam, ToolkitError


class TorchSharded(TorchDataParallel):
    """``toolkit.Sharded(stage)`` for ``horovod-torch`` (see :class:`toolkit.Adapter`)."""

    shards: ShardedParameters
    compresses = False  # (its reductions are the flat shards')
    counts = True  # the spec optimizer's step count is the UpdateRule's

    composes = ("replicate",)  # HSDP: the shards' group a node's ranks, replicas across

    @staticmethod
    def check_layout(layout: Any) -> None:
        if layout.dims.tensor > 1:
            raise ToolkitError(
                f"horovod-torch cannot split layers over ranks (layout {layout.name}, "
                f"tensor_parallel={layout.dims.tensor})",
                "only jax-pjit splits layers: use tensor_parallel=1 or --backend jax-pjit")

    def _build_optimizer(self, model: Any, optimizer: Any, seed: int) -> None:
        if not isinstance(optimizer, SGD | Adam):  # the user's torch.optim optimizer
            check_elementwise(self.torch, optimizer, "horovod-torch", self.layout.name)
            make_optimizer(self.torch, optimizer, [p for _, p, _, _ in self.params])
        if self.native:
            units = native_units(self.torch, self.net)
            self.hvd.broadcast_parameters(self.net.state_dict(), root_rank=0)
            arrays = {n: to_host(p, same) for n, p in self.net.named_parameters()}
        else:
            arrays = model.init(seed, self.runtime.dtype_name)
            units = spec_units(arrays)
        self.shards = ShardedParameters(self.torch, self.hvd, self.net, self.params, arrays,
                                        units, self.layout.dims.zero, optimizer, self.dtype,
                                        self.runtime.dev,
                                        None if self.native else self.precision.autocast,
                                        group=self.runtime.shard_group(self.layout))
        self.params = []  # the module's parameters are gone: the flat buffers hold them

    def _forwarding(self):
        return self.shards.forwarding()

    def _zero_grad(self) -> None:
        self.shards.zero_grad()

    def _apply(self, lr: float | None, scalars: Any, kept: list) -> Any:
        # (the count advanced with the scalars; a skipped step's comes off in UpdateRule)
        shards, by_name = self.shards, step_scalars(self.torch, scalars)
        shards.reduce()

        def apply(found_inf) -> None:
            shards.step(by_name, found_inf)
            self._count_update()

        return update(self.torch, self.rule, shards.grads, shards.sum_of_squares, apply,
                      kept, scalars)[1]

    def _skips_on_device(self) -> bool:
        # the spec arithmetic selects on the device; a native optimizer must take found_inf
        native = self.shards.native
        return native is None or takes_found_inf(native)

    def memory_bytes(self) -> dict[str, int]:
        return self.shards.memory_bytes()

    def _model_state(self) -> dict[str, np.ndarray]:
        out = super()._model_state()
        if self.scheduler is not None:
            out.update(scheduler_state(self.scheduler, self.shards.native))
        return out

    def state_dict(self) -> dict[str, np.ndarray]:
        return {**self.shards.state_dict(), **self._model_state()}

    def sharded_state(self) -> tuple[dict[str, np.ndarray], dict[str, tuple]]:
        """This rank's pieces of the sharded state (see ``toolkit.ShardedAdapter``)."""
        replicated, pieces = self.shards.sharded_state()
        return {**replicated, **self._model_state()}, pieces

    def _load(self, state: dict[str, np.ndarray], params_only: bool = False) -> None:
        with self.torch.no_grad():
            self.shards.load_state_dict(state)
        if self.scheduler is not None:
            load_scheduler_state(self.scheduler, self.shards.native, state)
        self.rule.load(state)
        self._load_model_state(state)
