"""The host side of the one update path, the same in every framework family.

Each family writes the update once, on its devices (``adapters/_jax/update.py``,
``adapters/horovod_torch/update.py``, ``adapters/horovod_tf/update.py``; the Horovod pipelines
reduce, unscale, measure and clip on the host, in numpy: :func:`update_host`, then the framework's
optimizer applies): the layout supplies the reduced gradient and the sum of its squares, then

    norm -> clip and finite check -> apply -> the old state kept when the step is skipped.

What stays on the host is this class, :class:`UpdateRule`: the build's ``clip_grad_norm`` and
``skip_nonfinite``, a spec optimizer's step count (Adam's ``t``) and each step's optimizer
scalars, and, after the step, its :class:`toolkit.StepResult` (reading the norm only when a
skip must be known, and taking the count back for a skipped step). Every strategy of every
backend keeps one, so the bookkeeping of a skipped step exists once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from adapters._common import nonfinite
from toolkit import SGD, Adam
from toolkit.contract import StepResult
from toolkit.models.reference import adam_scalars, clip_scale
from toolkit.precision import LossScaler, Precision


class UpdateRule:
    """One build's update settings and its host-side state.

    Args:
        optimizer: the build's optimizer: a spec (``toolkit.SGD``/``toolkit.Adam``: the count
            and scalars are kept here) or a native one (its framework counts).
        clip: ``clip_grad_norm`` (None: no clipping).
        skip: ``skip_nonfinite``: a step whose gradient norm is not finite changes nothing.

    Example:
        >>> rule = UpdateRule(Adam(lr=0.1), clip=1.0, skip=True)
        >>> rule.scalars(0.1)[0], rule.count
        (0.1, 1)
        >>> rule.result(0.5, float("nan")).skipped, rule.count
        (True, 0)
    """

    def __init__(self, optimizer: Any = None, clip: float | None = None, skip: bool = False,
                 precision: Precision | None = None):
        self.spec = optimizer if isinstance(optimizer, SGD | Adam) else None
        self.scaler = LossScaler() if precision is not None and precision.loss_scaling else None
        # skip: a step whose gradient is not finite changes nothing (asked for, or the
        # scaler's, which then lowers the scale: StepResult.overflow)
        self.clip, self.skip = clip, bool(skip) or self.scaler is not None
        self.count = 0  # optimizer steps of a spec optimizer (Adam's t)

    @property
    def loss_scale(self) -> float | None:
        """The scale of the next step's loss (None without loss scaling)."""
        return None if self.scaler is None else self.scaler.scale

    @property
    def needs_norm(self) -> bool:
        """Whether a step computes the gradient norm (to clip, or to know a skip): the
        reduction over every gradient costs 4-7% of a small CPU step, so only then."""
        return self.clip is not None or self.skip

    def scalars(self, lr: float) -> tuple[float, float, float]:
        """Counts one optimizer step of the spec and returns its ``(lr, step_size, c2_sqrt)``
        (``toolkit.models.reference.adam_scalars``; SGD: ``(lr, 0, 1)``)."""
        self.count += 1
        if isinstance(self.spec, Adam):
            return (lr, *adam_scalars(self.spec, self.count, lr))
        return lr, 0.0, 1.0

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


def update_host(rule: UpdateRule, grads: dict[str, np.ndarray],
                global_norm: Callable[[dict[str, np.ndarray]], float]
                ) -> tuple[dict[str, np.ndarray], float]:
    """The Horovod pipelines' update path on the host, before the framework's optimizer
    applies: the reduced gradients unscaled (fp16: by the loss scale, exactly: a power of two),
    their norm (``global_norm``: the layout adds up its stages' shares), the clip; returns
    ``(grads, norm)``. Call it only when ``rule.needs_norm`` (a scaler makes it so)."""
    if rule.scaler is not None:
        grads = {n: g * g.dtype.type(1.0 / rule.scaler.scale) for n, g in grads.items()}
    norm = global_norm(grads)
    return clip_host(rule, grads, norm), norm


def clip_host(rule: UpdateRule, grads: dict[str, np.ndarray], norm: float
              ) -> dict[str, np.ndarray]:
    """The numpy form of the clip, for gradients on the host (the Horovod pipelines): each
    scaled by ``clip / max(norm, clip)`` in its own dtype; as they are without a clip, or when
    the step will be skipped (``rule.skip`` and the norm not finite)."""
    if rule.clip is None or (rule.skip and nonfinite(norm)):
        return grads
    scale = clip_scale(norm, rule.clip)
    return {n: (g * scale).astype(g.dtype) for n, g in grads.items()}
