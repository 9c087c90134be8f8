"""The precision plugin: what a strategy asks of its precision policy, given to it when it is
made (Lightning Fabric's ``Precision`` plugin, one subclass per framework family).

A strategy calls its plugin, and writes nothing of the arithmetic's precision itself:

- the forward's precision: torch autocast (``horovod_torch/precision.py``), or the parameters
  and inputs cast to the compute dtype (``horovod_tf/precision.py``, ``_jax/precision.py``;
  a Keras model's layers take the Keras policy of the same arithmetic instead);
- :meth:`PrecisionPlugin.scale_loss`, the loss times fp16-mixed's loss scale before the
  backward pass: the one place a loss is scaled, in every layout of every family;
- the loss scaler (:attr:`PrecisionPlugin.scaler`, ``toolkit.precision.LossScaler``), whose
  scale each step carries (``StepScalars.loss_scale``); the family's update path unscales the
  gradients by it first and ``UpdateRule`` halves or grows it after the step.

The policy itself is framework-free (``toolkit.precision.Precision``); the plugin's
``name``, ``mixed``, ``compute_dtype`` and ``param_dtype`` are the policy's.
"""

from __future__ import annotations

from typing import Any

from toolkit.precision import LossScaler, Precision


class PrecisionPlugin:
    """One strategy's precision: ``policy`` (a ``toolkit.precision.Precision``) and its loss
    scaler, fresh for the strategy (``runtime``: the started runtime, whose framework a
    family's subclass takes).

    Example:
        >>> p = PrecisionPlugin(Precision.of("fp16-mixed").with_scaling(init_scale=8))
        >>> p.scale_loss(3.0), p.loss_scale, PrecisionPlugin(Precision.of("32")).scale_loss(3.0)
        (24.0, 8.0, 3.0)
    """

    def __init__(self, policy: Precision, runtime: Any = None):
        self.policy = policy
        self.scaler: LossScaler | None = policy.scaler()

    # ------------------------------------------------------------------ the policy's facts
    @property
    def name(self) -> str:
        return self.policy.name

    @property
    def mixed(self) -> bool:
        return self.policy.mixed

    @property
    def compute_dtype(self) -> str:
        return self.policy.compute_dtype

    @property
    def param_dtype(self) -> str:
        return self.policy.param_dtype

    # ------------------------------------------------------------------ loss scaling
    @property
    def loss_scale(self) -> float | None:
        """The scale of the next step's loss (None without loss scaling)."""
        return None if self.scaler is None else self.scaler.scale

    def step_scale(self, scalars: Any) -> Any:
        """(in a compiled step) The loss scale among the step's ``StepScalars``; None without
        loss scaling, so that an unscaled step has no multiplication at all."""
        return None if self.scaler is None else scalars.loss_scale

    def scale_loss(self, loss: Any, scale: Any = None) -> Any:
        """The loss the backward pass differentiates: ``loss`` times the loss scale under
        fp16-mixed (``scale``: the step's own, a device scalar inside a compiled step; else
        the scaler's), ``loss`` itself otherwise. A power of two: the family's update divides
        the gradients by it exactly."""
        if self.scaler is None:
            return loss
        return loss * (self.scaler.scale if scale is None else scale)
