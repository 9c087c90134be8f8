"""The ``horovod-torch`` backend: PyTorch with Horovod's collectives.

``runtime.py`` starts Horovod; ``ops.py`` holds the torch arithmetic every layout shares
(tensors, losses, evaluation sums, optimizers); one strategy per layout: ``data_parallel.py``
(Horovod's ``DistributedOptimizer``), ``sharded.py`` (ZeRO 1-3 / FSDP over flat shards,
``flat_shards.py``), ``pipeline.py`` (stages cut by ``stages.py``). ``models/`` builds torch
modules from the toolkit's specs. Importing this package imports no framework.
"""

from typing import Any

from adapters._backend import Backend

_HERE = "adapters.horovod_torch"


class HorovodTorchAdapter(Backend):
    """PyTorch + Horovod. See :class:`toolkit.Adapter` for the contract."""

    name = "horovod-torch"
    runtime_class = f"{_HERE}.runtime:TorchRuntime"
    strategies = {
        "data_parallel": f"{_HERE}.data_parallel:TorchDataParallel",
        "sharded": f"{_HERE}.sharded:TorchSharded",
        "pipeline": f"{_HERE}.pipeline:TorchPipeline",
    }

    def device_batch(self, x: Any, y: Any) -> tuple[Any, Any]:
        """``toolkit.contract.PlacesBatches``: on a GPU, the batch copied to it ahead of its
        step (in the Trainer's prefetch thread); on the CPU, the arrays untouched."""
        return self.runtime.device_batch(x, y)
