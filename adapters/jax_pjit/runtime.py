"""The ``jax-pjit`` runtime: JAX started for the launch (``adapters._jax.runtime``)."""

from adapters._jax.runtime import JaxRuntime


class PjitRuntime(JaxRuntime):
    backend = "jax-pjit"
