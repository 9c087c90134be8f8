"""The host side of the one update path, the same in every framework family.

Each family writes the update once, on its devices (``adapters/_jax/update.py``,
``adapters/horovod_torch/update.py``, ``adapters/horovod_tf/update.py``), and every layout of
the family calls it, pipelines included: the layout supplies the reduced gradient and how the
squares of the whole gradient add up, then

    unscale -> norm -> clip and finite check -> apply -> the old state kept when skipped.

What stays on the host is this class, :class:`UpdateRule`: the build's ``clip_grad_norm`` and
``skip_nonfinite``, a spec optimizer's step count (Adam's ``t``) and each step's optimizer
scalars, and, after the step, its :class:`toolkit.StepResult` (reading the norm only when a
skip must be known, and taking the count back for a skipped step). Every strategy of every
backend keeps one, so the bookkeeping of a skipped step exists once.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from adapters._common import nonfinite
from toolkit import SGD, Adam
from toolkit.contract import StepResult
from toolkit.models.reference import adam_scalars
from toolkit.precision import LossScaler


class StepScalars(NamedTuple):
    """One step's numbers from the host, read by name in every compiled step.

    ``lr``; Adam's ``step_size`` and ``c2_sqrt`` (``toolkit.models.reference.adam_scalars``;
    SGD and native optimizers: 0 and 1); ``loss_scale`` (1 without loss scaling). They travel
    as one vector in this order (:meth:`vector`: one host-to-device copy per step) and are
    read back by name inside the step (:meth:`of`).

    Example:
        >>> StepScalars.of(StepScalars(0.1, 0.0, 1.0, 8.0).vector("float32")).loss_scale
        np.float32(8.0)
    """

    lr: Any
    step_size: Any
    c2_sqrt: Any
    loss_scale: Any

    def vector(self, dtype) -> np.ndarray:
        """The scalars as one vector of ``dtype``."""
        return np.asarray(self, dtype)

    @classmethod
    def of(cls, vector: Any) -> StepScalars:
        """The named view of a :meth:`vector` (a numpy, TF or JAX vector, or a traced one)."""
        return cls(*(vector[i] for i in range(len(cls._fields))))

    @classmethod
    def zeros(cls, dtype) -> np.ndarray:
        """A vector shaped as every step's (for compiling ahead)."""
        return np.zeros(len(cls._fields), dtype)


class UpdateRule:
    """One build's update settings and its host-side state.

    Args:
        optimizer: the build's optimizer: a spec (``toolkit.SGD``/``toolkit.Adam``: the count
            and scalars are kept here) or a native one (its framework counts).
        clip: ``clip_grad_norm`` (None: no clipping).
        skip: ``skip_nonfinite``: a step whose gradient norm is not finite changes nothing.
        scaler: the precision plugin's loss scaler (fp16-mixed), whose scale each step
            carries and which this rule halves or grows after the step (None: no scaling).

    Example:
        >>> rule = UpdateRule(Adam(lr=0.1), clip=1.0, skip=True)
        >>> rule.scalars(0.1).lr, rule.count
        (0.1, 1)
        >>> rule.result(0.5, float("nan")).skipped, rule.count
        (True, 0)
    """

    def __init__(self, optimizer: Any = None, clip: float | None = None, skip: bool = False,
                 scaler: LossScaler | None = None):
        self.spec = optimizer if isinstance(optimizer, SGD | Adam) else None
        self.scaler = scaler  # the precision plugin's (adapters/_precision.py), or None
        # skip: a step whose gradient is not finite changes nothing (asked for, or the
        # scaler's, which then lowers the scale: StepResult.overflow)
        self.clip, self.skip = clip, bool(skip) or self.scaler is not None
        self.count = 0  # optimizer steps of a spec optimizer (Adam's t)

    @property
    def needs_norm(self) -> bool:
        """Whether a step computes the gradient norm (to clip, or to know a skip): it
        reads every gradient once more, a cost worth paying only then (docs/equivalence.md)."""
        return self.clip is not None or self.skip

    def scalars(self, lr: float | None) -> StepScalars:
        """Counts one optimizer step of the spec and returns this step's :class:`StepScalars`
        (``lr`` None, for an optimizer that keeps its own rate: 0)."""
        self.count += 1
        lr = 0.0 if lr is None else lr
        step_size, c2_sqrt = (adam_scalars(self.spec, self.count, lr)
                              if isinstance(self.spec, Adam) else (0.0, 1.0))
        return StepScalars(lr, step_size, c2_sqrt,
                           1.0 if self.scaler is None else self.scaler.scale)


    def result(self, loss: Any, norm: Any, skipped: bool | None = None) -> StepResult:
        """The step's :class:`StepResult` from its ``loss`` and gradient ``norm`` (a framework
        scalar; ignored unless :attr:`needs_norm`). ``skipped`` None: read from the norm when
        skipping (one device-to-host copy); a skipped step's optimizer count is taken back."""
        if not self.needs_norm:
            return StepResult(loss)
        if skipped is None:
            skipped = self.skip and nonfinite(norm)
        if skipped and self.spec is not None:
            self.count -= 1
        if self.scaler is None:
            return StepResult(loss, norm, bool(skipped))
        used = self.scaler.scale
        self.scaler.update(finite=not skipped)
        return StepResult(loss, norm, bool(skipped), used, overflow=bool(skipped))

    # -------------------------------------------------------------------------- state
    def counters(self) -> dict[str, np.ndarray]:
        """``opt/count`` for an Adam spec and the loss scaler's state, as the checkpoint
        stores them."""
        out = {"opt/count": np.asarray(self.count, np.int64)} \
            if isinstance(self.spec, Adam) else {}
        return out if self.scaler is None else {**out, **self.scaler.state()}

    def load(self, state: dict[str, np.ndarray]) -> None:
        """The count and the loss scaler's state from a checkpoint's state, where it has
        them."""
        if "opt/count" in state:
            self.count = int(state["opt/count"])
        if self.scaler is not None:
            self.scaler.load(state)
