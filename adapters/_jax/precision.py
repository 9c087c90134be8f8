"""The JAX family's precision plugin (``adapters/_jax/precision.py``, on
``adapters/_precision.py``): the parameters and inputs cast to the compute dtype inside the
jitted step (gathered shards included: what a sharded layout gathers is then half as many
bytes under bfloat16), the loss in the parameters' dtype, the loss scaled by the base class."""

from __future__ import annotations

from typing import Any

from adapters._jax.models.spec import in_compute
from adapters._precision import PrecisionPlugin
from toolkit.precision import Precision


class JaxPrecision(PrecisionPlugin):
    """``policy`` for ``runtime.jax``; :attr:`compute` is the compute dtype (None: the
    parameters' own)."""

    def __init__(self, policy: Precision, runtime: Any):
        super().__init__(policy, runtime)
        self.jax = runtime.jax
        self.compute = getattr(self.jax.numpy, policy.compute_dtype) if policy.mixed else None

    def in_compute(self, tree: Any) -> Any:
        """``tree``'s floating leaves in the compute dtype; ``tree`` itself without one."""
        return tree if self.compute is None else in_compute(self.jax, tree, self.compute)
