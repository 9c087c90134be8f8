"""The ``jax-pjit`` backend: ``jax.jit`` over a ``Mesh`` of every process's devices.

Data parallel (the default layout): the batch is sharded on the mesh's ``data`` axis
(``NamedSharding(mesh, P("data"))``), the parameters and optimizer state are replicated
(``P()``); the compiler inserts the gradient all-reduce. Each process contributes its local
samples through ``jax.make_array_from_process_local_data``.

Sharded layouts (``toolkit.Sharded``, see ``adapters/jax_pjit/sharded.py``): the state lives in
flat per-unit buffers sharded ``P("data")`` and the compiler inserts the all-gathers and
reduce-scatters; ``tensor_parallel=k`` adds a ``model`` axis that splits the GPT's attention
and MLP kernels (Megatron style).

Pipeline stages (``toolkit.Pipeline``, see ``adapters/jax_pjit/pipeline.py``): a (stage, data)
mesh; stages exchange activations and gradients with ``lax.ppermute`` inside ``shard_map``.
"""

from __future__ import annotations

import numpy as np

from adapters._backend import Backend

_HERE = "adapters.jax_pjit"


class JaxPjitAdapter(Backend):
    """JAX with jit over a device mesh. See :class:`toolkit.Adapter` for the contract.
    Strategies: ``data_parallel.py``, ``sharded.py``, ``pipeline.py``."""

    name = "jax-pjit"
    runtime_class = f"{_HERE}.runtime:PjitRuntime"
    strategies = {"data_parallel": f"{_HERE}.data_parallel:PjitDataParallel",
                  "sharded": f"{_HERE}.sharded:PjitSharded",
                  "pipeline": f"{_HERE}.pipeline:PjitPipeline"}

    def device_batch(self, x: np.ndarray, y: np.ndarray):
        """``toolkit.contract.PlacesBatches``: the strategy's placement of a local batch."""
        return self.strategy.device_batch(x, y)
