"""The torch family's one update path, after the layout has reduced the gradient.

Every ``horovod-torch`` layout hands :func:`update` this rank's reduced gradient tensors (the
whole gradient for data parallel and stage 1, this rank's shards for stages 2 and 3), how to
take their global norm, and how to apply them; the rest is written once, here:

    unscale (fp16-mixed: by the step's loss scale, exactly: a power of two) -> norm -> finite
    check (``skip_nonfinite``: a skipped step applies nothing) -> clip
    (``clip / max(norm, clip)``) -> apply -> the old state kept when skipped.

The sum of squares is the layout's, since where the gradient lives decides how its elements
add up: data parallel and the pipeline stages square the per-tensor norms (one fused kernel for
all tensors: :func:`sum_of_squares`), the flat shards sum their elements' squares, across ranks
for stages 2 and 3 (``flat_shards.ShardedParameters.sum_of_squares``). The host side (clip,
skip, a spec optimizer's step count and scalars, the step's ``StepResult``) is
``adapters._update.UpdateRule``.

Where the finite check is decided: a torch optimizer's ``step()`` is host code, so a step
that must not apply is either known on the host (the norm read after the backward pass, as
``torch.amp.GradScaler`` reads its ``found_inf`` for most optimizers) or handed to an
optimizer that takes it as a device flag: torch's fused kernels skip their update and their
step count where ``found_inf`` is set (:func:`takes_found_inf`). With such an optimizer and
:class:`~adapters._update.Deferred` scalars, nothing is read on the host: the update passes
the flag, keeps the old statistics by a device-side select, and advances the rule's counters
on the device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from adapters._common import nonfinite
from adapters._update import Counters, Deferred, Report, StepScalars, UpdateRule, advance


def sum_of_squares(torch, grads: list, dtype: Any = None, device: Any = None):
    """The sum of the squares of every element of ``grads`` as the squares of their norms
    (``torch._foreach_norm``: one kernel for every tensor); a zero of ``dtype`` on ``device``
    without gradients."""
    if not grads:
        return torch.zeros((), dtype=dtype, device=device)
    return torch.stack(torch._foreach_norm(grads)).square().sum()


def clip_(torch, grads: list, norm, clip: float) -> None:
    """Scales ``grads`` in place by ``clip / max(norm, clip)`` (``toolkit.models.reference``'s
    rule; ``torch.nn.utils.clip_grad_norm_`` divides by ``norm + 1e-6`` instead)."""
    torch._foreach_mul_(grads, clip / torch.clamp(norm, min=clip))


def takes_found_inf(optimizer: Any) -> bool:
    """Whether ``optimizer``'s ``step()`` takes a skip as a device flag (``found_inf``, as
    ``torch.amp.GradScaler`` hands it to torch's fused Adam, AdamW and SGD): then a step's
    skip need not be read on the host. Its param groups say it (``fused``): Horovod's
    ``DistributedOptimizer`` remakes the optimizer from them, without the constructor's
    ``_step_supports_amp_scaling``."""
    groups = getattr(optimizer, "param_groups", None)
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) or bool(
        groups and all(g.get("fused") for g in groups))


def step_scalars(torch, scalars: Any) -> StepScalars:
    """The step's :class:`StepScalars` by name: host numbers, or of :class:`Deferred` scalars
    (tensors on the device) the table's row for the skips counted (``Deferred.read``)."""
    if not isinstance(scalars, Deferred):
        return scalars
    return scalars.read(lambda table, skips: table[skips.long()])


def update(torch, rule: UpdateRule, grads: list, sum_squares: Callable[[list], Any],
           apply: Callable[[Any], None], keep: list | tuple = (),
           scalars: Any = None) -> tuple[list, Any]:
    """One update under ``rule`` (its ``clip``, ``skip`` and loss scaler).

    Args:
        torch: the ``torch`` module.
        rule: the build's ``UpdateRule``.
        grads: the reduced gradient tensors, clipped (and unscaled) in place.
        sum_squares: the sum of the squares of the whole gradient, given ``grads`` (the
            layout adds up its ranks' shares); called only when ``rule.needs_norm``.
        apply: the optimizer's update from ``grads``, given ``found_inf``: None (the step is
            known to be finite), or with :class:`Deferred` scalars a float32 tensor, non-zero
            where the step must change nothing (for the optimizer's fused kernel).
        keep: ``(tensor, value before the step)`` pairs (BatchNorm statistics) that a skipped
            step puts back.
        scalars: the step's scalars (``UpdateRule.step_scalars``): host ``StepScalars``, or
            :class:`Deferred` ones as tensors on the device.

    Returns:
        ``(grads, norm)``: the norm before clipping (a tensor; None unless
        ``rule.needs_norm``), which ``UpdateRule.result`` reads for the skip (a skipped step
        clipped and applied nothing; the norm is global, so every rank skips alike); with
        :class:`Deferred` scalars the step's :class:`Report` in its place: nothing is read on
        the host.
    """
    if not rule.needs_norm:
        apply(None)
        return grads, None
    deferred = isinstance(scalars, Deferred)
    if rule.scaler is not None:  # the gradients of the scaled loss, unscaled (exactly: a
        scale = step_scalars(torch, scalars).loss_scale if deferred else rule.scaler.scale
        torch._foreach_mul_(grads, 1.0 / scale)  # power of two)
    norm = torch.sqrt(sum_squares(grads))
    if not deferred:
        if rule.skip and nonfinite(norm):
            with torch.no_grad():
                for tensor, before in keep:
                    tensor.copy_(before)
            return grads, norm
        if rule.clip is not None:
            clip_(torch, grads, norm, rule.clip)
        apply(None)
        return grads, norm
    finite = torch.isfinite(norm)
    if rule.clip is not None:  # (not finite: the gradient is not applied)
        clip_(torch, grads, norm, rule.clip)
    apply((~finite).float())  # (float32, as torch.amp.GradScaler hands it over)
    with torch.no_grad():
        for tensor, before in keep:
            tensor.copy_(torch.where(finite, tensor, before))
    return grads, Report(norm, advance(torch, rule.scaler, scalars.counters, finite), ~finite,
                         Counters.of(scalars.counters).loss_scale)
