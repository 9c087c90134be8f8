"""The optimizers' arithmetic written once in numpy: the definition every backend must match.

Used as the one-process reference of the equivalence check and in the conformance tests. The
formulas are torch.optim's (SGD with dampening 0; Adam/AdamW with bias corrections computed in
double precision on the host and eps outside the square root).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from toolkit.models.specs import SGD, Adam, OptimizerSpec


def optimizer_slots(spec: OptimizerSpec) -> tuple[str, ...]:
    """The per-parameter state of ``spec``, by neutral name (``opt/<slot>/<param>``)."""
    if isinstance(spec, Adam):
        return ("mu", "nu")
    return ("momentum",) if spec.momentum else ()


def init_state(spec: OptimizerSpec, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Zero optimizer state with the checkpoint format's names."""
    state = {f"opt/{slot}/{name}": np.zeros_like(p)
             for slot in optimizer_slots(spec) for name, p in params.items()}
    if isinstance(spec, Adam):
        state["opt/count"] = np.asarray(0, np.int64)
    return state


def adam_scalars(spec: Adam, t: int, lr: float) -> tuple[float, float]:
    """Adam's host-side scalars for step ``t`` (1-based): ``lr / c1`` and ``sqrt(c2)``."""
    return lr / (1 - spec.b1 ** t), math.sqrt(1 - spec.b2 ** t)


def apply_update(spec: OptimizerSpec, params: dict[str, np.ndarray],
                 grads: dict[str, np.ndarray], state: dict[str, np.ndarray], lr: float):
    """One optimizer step; returns new ``(params, state)`` (inputs are not modified)."""
    params, state = dict(params), dict(state)
    if isinstance(spec, SGD):
        for name, p in params.items():
            g = grads[name] + spec.weight_decay * p if spec.weight_decay else grads[name]
            if spec.momentum:
                buf = spec.momentum * state[f"opt/momentum/{name}"] + g
                state[f"opt/momentum/{name}"] = buf
                g = g + spec.momentum * buf if spec.nesterov else buf
            params[name] = p - lr * g
        return params, state
    t = int(state["opt/count"]) + 1
    state["opt/count"] = np.asarray(t, np.int64)
    step_size, c2_sqrt = adam_scalars(spec, t, lr)
    for name, p in params.items():
        g = grads[name]
        if spec.decoupled:
            p = p * (1 - lr * spec.weight_decay)
        elif spec.weight_decay:
            g = g + spec.weight_decay * p
        m = spec.b1 * state[f"opt/mu/{name}"] + (1 - spec.b1) * g
        v = spec.b2 * state[f"opt/nu/{name}"] + (1 - spec.b2) * g * g
        state[f"opt/mu/{name}"], state[f"opt/nu/{name}"] = m, v
        params[name] = p - step_size * m / (np.sqrt(v) / c2_sqrt + spec.eps)
    return params, state


def global_norm(grads: dict[str, np.ndarray]) -> float:
    """The norm of the whole gradient: every element of every tensor, once."""
    return math.sqrt(sum(float(np.sum(np.square(g, dtype=np.float64))) for g in grads.values()))


def clip_scale(norm: float, max_norm: float) -> float:
    """The factor clipping by global norm multiplies the gradient by: ``max_norm / max(norm,
    max_norm)`` (1 when the norm is within the bound; optax's ``clip_by_global_norm``, which
    adds no epsilon, unlike ``torch.nn.utils.clip_grad_norm_``'s ``max_norm / (norm + 1e-6)``).
    Every backend computes this same factor."""
    return max_norm / max(norm, max_norm)


def check_clip(value) -> float | None:
    """``clip_grad_norm`` as given (None: no clipping), refused unless a positive number."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not math.isfinite(value) or value <= 0:
        from toolkit.errors import ToolkitError

        raise ToolkitError(f"clip_grad_norm={value!r} is not a positive number",
                           "use e.g. 1.0 (the norm of the whole gradient after averaging), "
                           "or None for no clipping")
    return float(value)


def _split_grads(model, params, x, y, loss, compute, split, scale=1.0, weight=1.0):
    """The mean loss and gradient of a global batch split over ``split = (ranks, devices)``
    (``(1, 1)``: the batch itself), each part's backward of its mean loss times ``scale`` x
    ``weight``."""
    if compute is None and split == (1, 1):
        return model.loss_and_grads(params, x, y, loss)
    ranks, devices = split
    parts = [model.loss_and_grads(params, xp, yp, loss, compute=compute, scale=scale * weight)
             for r in range(ranks)
             for xp, yp in zip(np.split(x[r::ranks], devices), np.split(y[r::ranks], devices),
                               strict=True)]
    grads = {n: (sum(g[n].astype(np.float64) for _, g in parts) / len(parts) / weight
                 ).astype(a.dtype) for n, a in params.items()}
    return float(np.mean([v for v, _ in parts])), grads


def reference_run(model, optimizer: OptimizerSpec, loss: str, x: np.ndarray, y: np.ndarray, *,
                  global_batch_size: int, steps: int, seed: int = 0, dtype: str = "float64",
                  clip_grad_norm: float | None = None, norms: list[float] | None = None,
                  compute: str | None = None,
                  split: tuple[int, int] = (1, 1), part_weight: float = 1.0,
                  scaler: Any = None) -> tuple[list[float], dict[str, np.ndarray]]:
    """Sequential training in numpy: one process, the global batch, the same sampler.

    ``clip_grad_norm``: scale each step's gradient by :func:`clip_scale` of its
    :func:`global_norm`; ``norms``, when given, receives every step's norm before clipping.
    ``compute``: the arithmetic's dtype under mixed precision (``bfloat16``, ``float16``;
    the model's ``loss_and_grads`` rounds to it), the parameters and the optimizer's arithmetic
    staying in ``dtype``; ``split``: ``(ranks, devices per rank)`` of data parallelism: the
    global batch split as the sampler gives ranks their samples (rank ``r`` every ``r``-th)
    and a rank its devices (contiguous parts), each part's gradient in the compute dtype's
    arithmetic, their mean in ``dtype`` (the same as the whole batch's in exact arithmetic,
    not in rounded arithmetic). ``part_weight``: what each part's mean loss is multiplied by
    before its backward pass (a pipeline's micro-batches: ``1 / M`` in horovod-torch, the
    part's share of the global batch in JAX), so its float16 gradients overflow where the run's
    do; the parts' gradients are divided by it again. ``scaler``: a
    ``toolkit.precision.LossScaler`` (fp16): the loss scaled, the gradients unscaled, a step
    whose gradient is not finite skipped and the scale updated, as the strategies' update path
    does.

    Returns:
        The loss of every step and the final parameters (neutral names, no prefix).
    """
    from toolkit.data.sampler import GlobalBatchSampler
    from toolkit.models.specs import learning_rate

    params = model.init(seed, dtype)
    state = init_state(optimizer, params)
    sampler = GlobalBatchSampler(len(x), global_batch_size, seed=seed)
    x = np.asarray(x)
    if np.issubdtype(x.dtype, np.floating):  # token ids stay integers
        x = x.astype(dtype)
    losses: list[float] = []
    while len(losses) < steps:
        for idx in sampler:
            scale = 1.0 if scaler is None else scaler.scale
            value, grads = _split_grads(model, params, x[idx], y[idx], loss, compute, split,
                                        scale, part_weight)
            if scaler is not None:
                grads = {n: g * g.dtype.type(1.0 / scale) for n, g in grads.items()}
            norm = global_norm(grads)
            if norms is not None:
                norms.append(norm)
            if clip_grad_norm is not None and norm > clip_grad_norm:
                scale = clip_scale(norm, clip_grad_norm)
                grads = {n: (g * scale).astype(g.dtype) for n, g in grads.items()}
            if scaler is not None:
                scaler.update(finite=math.isfinite(norm))
            if scaler is None or math.isfinite(norm):
                params, state = apply_update(optimizer, params, grads, state,
                                             learning_rate(optimizer, len(losses)))
            losses.append(value)
            if len(losses) == steps:
                break
    return losses, params
