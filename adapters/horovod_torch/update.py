"""The torch family's one update path, after the layout has reduced the gradient.

Every ``horovod-torch`` layout hands :func:`update` this rank's reduced gradient tensors (the
whole gradient for data parallel and stage 1, this rank's shards for stages 2 and 3), how to
take their global norm, and how to apply them; the rest is written once, here:

    norm -> finite check (``skip_nonfinite``: a skipped step applies nothing) -> clip
    (``clip / max(norm, clip)``) -> apply.

The norm is the layout's, since where the gradient lives decides how its elements add up:
data parallel takes the norm of the per-tensor norms (:func:`norm_of_norms`), the flat shards
the square root of the sum of squares, summed across ranks for stages 2 and 3
(``flat_shards.ShardedParameters.norm``). The host side (clip, skip, a spec optimizer's step
count and scalars, the step's ``StepResult``) is ``adapters._update.UpdateRule``. Anything
that changes the gradient before its norm (unscaling a scaled loss) goes at the top of
:func:`update`, before the norm is taken.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from adapters._common import nonfinite
from adapters._update import UpdateRule


def norm_of_norms(torch, grads: list):
    """The norm of ``grads`` (every element once, in their dtype) as the norm of the
    per-tensor norms; None without gradients. A tensor, read on the host only when the
    Trainer logs it or a skip must be known."""
    if not grads:
        return None
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))


def clip_(torch, grads: list, norm, clip: float) -> None:
    """Scales ``grads`` in place by ``clip / max(norm, clip)`` (``toolkit.models.reference``'s
    rule; ``torch.nn.utils.clip_grad_norm_`` divides by ``norm + 1e-6`` instead)."""
    torch._foreach_mul_(grads, clip / torch.clamp(norm, min=clip))


def update(torch, rule: UpdateRule, grads: list, norm: Callable[[], Any],
           apply: Callable[[], None]) -> tuple[Any, bool]:
    """One update under ``rule`` (its ``clip`` and ``skip``): ``norm()`` is the whole
    gradient's norm (taken only when ``rule.needs_norm``: it reads every gradient once
    more), ``grads`` are clipped in place, then ``apply()`` updates
    the parameters from them. Returns ``(the norm before clipping, skipped)``: the norm a
    tensor (None when not taken, or without gradients), skipped whether the norm was not
    finite under ``skip``, in which case nothing was clipped or applied (the norm is global,
    so every rank skips alike)."""
    if not rule.needs_norm:
        apply()
        return None, False
    if rule.scaler is not None:  # the gradients of the scaled loss, unscaled (exactly: a
        torch._foreach_mul_(grads, 1.0 / rule.scaler.scale)  # power of two)
    value = norm()
    if rule.skip and nonfinite(value):
        return value, True
    if rule.clip is not None and value is not None:
        clip_(torch, grads, value, rule.clip)
    apply()
    return value, False
