"""The torch family's precision plugin (``adapters/_precision.py``): the forward pass under
torch autocast to the compute dtype (matmuls and convolutions in it, the parameters float32),
the loss scaled by the base class."""

from __future__ import annotations

import contextlib
from typing import Any

from adapters._precision import PrecisionPlugin
from toolkit.precision import Precision


class TorchPrecision(PrecisionPlugin):
    """``policy`` on the runtime's device (``runtime.torch``, ``runtime.dev``)."""

    def __init__(self, policy: Precision, runtime: Any):
        super().__init__(policy, runtime)
        self.torch = runtime.torch
        self.autocast = getattr(self.torch, policy.compute_dtype) if policy.mixed else None
        self.device_type = runtime.dev.type if runtime.dev is not None else "cpu"

    def forward_context(self):
        """What a forward pass runs inside: torch autocast to the compute dtype under a mixed
        policy, else nothing."""
        if self.autocast is None:
            return contextlib.nullcontext()
        return self.torch.autocast(self.device_type, dtype=self.autocast)
