"""The ``jax-pmap`` backend: ``jax.pmap`` over the local devices, gradients averaged with
``lax.pmean``; several processes join through ``jax.distributed`` (Gloo on CPU).

Pipeline stages (``toolkit.Pipeline``, see ``adapters/jax_pmap/pipeline.py``): pmap over every
process's devices, stages exchanging activations and gradients with ``lax.ppermute``.

``pmap`` is in maintenance mode in current JAX; it works on the pinned JAX 0.10.2. New code
should prefer ``jax-pjit`` (``jax.jit`` over a device ``Mesh``), which gives the same data
parallelism, lets the compiler place the collectives, and extends to sharded parameters.
"""

from __future__ import annotations

from adapters._backend import Backend

_HERE = "adapters.jax_pmap"


class JaxPmapAdapter(Backend):
    """JAX with pmap. See :class:`toolkit.Adapter` for the contract. Strategies:
    ``data_parallel.py``, ``sharded.py`` (explicit ``lax.all_gather`` / ``lax.psum_scatter``
    on flat per-unit buffers) and ``pipeline.py`` (``lax.ppermute`` between device indices)."""

    name = "jax-pmap"
    runtime_class = f"{_HERE}.runtime:PmapRuntime"
    strategies = {"data_parallel": f"{_HERE}.data_parallel:PmapDataParallel",
                  "sharded": f"{_HERE}.sharded:PmapSharded",
                  "pipeline": f"{_HERE}.pipeline:PmapPipeline"}
