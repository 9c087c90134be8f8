"""The ``jax-pmap`` runtime: JAX started for the launch (``adapters._jax.runtime``)."""

from adapters._jax.runtime import JaxRuntime


class PmapRuntime(JaxRuntime):
    backend = "jax-pmap"
