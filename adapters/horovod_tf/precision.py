"""The TF family's precision plugin (``adapters/_precision.py``): a spec model's variables and
inputs cast to the compute dtype inside the compiled step (their gradients come back in the
parameters' dtype); a Keras model's layers take the Keras policy of the same arithmetic
(``models/keras_native.py``, ``apply_precision``); the loss scaled by the base class."""

from __future__ import annotations

from typing import Any

from adapters._precision import PrecisionPlugin
from toolkit.precision import Precision


class TFPrecision(PrecisionPlugin):
    """``policy`` for ``runtime.tf``; :attr:`compute` is the compute dtype (None: the
    parameters' own)."""

    def __init__(self, policy: Precision, runtime: Any):
        super().__init__(policy, runtime)
        self.tf = runtime.tf
        self.compute = getattr(self.tf, policy.compute_dtype) if policy.mixed else None

    def in_compute(self, tree: Any) -> Any:
        """``tree``'s floating tensors in the compute dtype; as they are without one."""
        tf = self.tf
        if self.compute is None:
            return tree

        def cast(t):
            t = tf.convert_to_tensor(t)
            return tf.cast(t, self.compute) if t.dtype.is_floating else t
        return tf.nest.map_structure(cast, tree)
