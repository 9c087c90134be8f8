"""The JAX family's one update path, inside every compiled step of both JAX backends.

The layout supplies the reduced gradient and how to add up its squares (a ``psum`` across
shards or stages where each device holds a part); :func:`update` does the rest, once:

    norm -> clip (``clip / max(norm, clip)``) -> apply -> the old state where the norm is
    not finite (``skip_nonfinite``: a skipped step changes no parameter, slot or statistic).

The optimizer is an optax ``GradientTransformation``: the spec optimizers
(``toolkit.SGD``/``toolkit.Adam``) as :func:`make_optimizer` builds them, or the user's own.
The host side (the spec's step count and scalars, the step's ``StepResult``) is
``adapters._update.UpdateRule``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from adapters._update import Deferred, Report, StepScalars, advance
from toolkit import SGD, Adam, ToolkitError
from toolkit.errors import describe
from toolkit.models.reference import optimizer_slots


def is_native(optimizer: Any) -> bool:
    """Whether ``optimizer`` is the user's optax transformation (not a toolkit spec)."""
    import optax

    return isinstance(optimizer, optax.GradientTransformation)


def make_optimizer(spec: Any, backend: str):
    """An optax GradientTransformationExtraArgs doing toolkit.models.reference's arithmetic.

    ``update(grads, state, params, lr=, step_size=, c2_sqrt=)``: the step's learning rate and
    Adam's host-computed scalars arrive as arguments, as in torch.optim, instead of being
    recomputed in float32 inside the graph (optax.adam's way, about 1e-5 away from torch).
    A native optax transformation is used as it is.
    """
    import jax
    import jax.numpy as jnp
    import optax

    if is_native(spec):
        return spec
    if not isinstance(spec, SGD | Adam):
        raise ToolkitError(f"{backend} cannot build an optimizer from {describe(spec)}",
                           "pass toolkit.SGD(...)/toolkit.Adam(...) or an optax transformation")
    slots = optimizer_slots(spec)
    tmap = jax.tree_util.tree_map

    def init(params):
        return {slot: tmap(jnp.zeros_like, params) for slot in slots}

    def update(grads, state, params, *, lr, step_size, c2_sqrt, **_):
        if isinstance(spec, SGD):
            if spec.weight_decay:
                grads = tmap(lambda g, p: g + spec.weight_decay * p, grads, params)
            if spec.momentum:
                buf = tmap(lambda b, g: spec.momentum * b + g, state["momentum"], grads)
                state = {"momentum": buf}
                grads = (tmap(lambda g, b: g + spec.momentum * b, grads, buf)
                         if spec.nesterov else buf)
            return tmap(lambda g: -lr * g, grads), state
        if spec.weight_decay and not spec.decoupled:
            grads = tmap(lambda g, p: g + spec.weight_decay * p, grads, params)
        m = tmap(lambda m, g: spec.b1 * m + (1 - spec.b1) * g, state["mu"], grads)
        v = tmap(lambda v, g: spec.b2 * v + (1 - spec.b2) * g * g, state["nu"], grads)

        def delta(p, m, v):
            decayed = p * (1 - lr * spec.weight_decay) if spec.decoupled else p
            return decayed - step_size * m / (jnp.sqrt(v) / c2_sqrt + spec.eps) - p

        return tmap(delta, params, m, v), {"mu": m, "nu": v}

    return optax.GradientTransformationExtraArgs(init, update)


def step_scalars(scalars) -> StepScalars:
    """(in a step) The step's :class:`StepScalars` by name, of a plain vector or of
    :class:`Deferred` scalars (``Deferred.read``)."""
    import jax.numpy as jnp

    if not isinstance(scalars, Deferred):
        return StepScalars.of(scalars)
    return scalars.read(lambda table, skips: table[skips.astype(jnp.int32)])


def apply_optimizer(rule, tx, grads, opt_state, params, scalars):
    """One update with either our transformation (``rule.spec``: the step's ``StepScalars``
    vector ``scalars`` gives its learning rate and Adam's scalars) or a native optax one."""
    import optax

    if rule.spec is not None:
        s = step_scalars(scalars)
        updates, opt_state = tx.update(grads, opt_state, params, lr=s.lr,
                                       step_size=s.step_size, c2_sqrt=s.c2_sqrt)
    else:
        updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def squares(jnp, tree) -> Any:
    """The sum of the squares of every element of ``tree`` (a gradient, or a shard of it)."""
    import jax

    return sum(jnp.sum(jnp.square(g)) for g in jax.tree_util.tree_leaves(tree))


def clip_by_norm(jnp, tree, sum_squares: Callable[[], Any], clip: float | None,
                 need_norm: bool = False):
    """``(tree scaled by clip / max(norm, clip), norm)`` for the whole gradient's
    ``sum_squares()`` (``toolkit.models.reference.clip_scale``); ``clip`` None: ``tree`` as it
    is, and the norm only with ``need_norm`` (skipping non-finite steps), else a zero in its
    place (the norm reads every gradient once more)."""
    import jax

    if clip is None and not need_norm:
        return tree, jnp.zeros(())
    norm = jnp.sqrt(sum_squares())
    if clip is None:
        return tree, norm
    scale = clip / jnp.maximum(norm, clip)
    return jax.tree_util.tree_map(lambda g: g * scale.astype(g.dtype), tree), norm


def keep_if_finite(jnp, norm, new, old):
    """``new`` where the gradient ``norm`` (the same on every device) is finite, else ``old``:
    a skipped step (``on_nonfinite="skip"``) changes no parameter, slot or statistic."""
    import jax

    ok = jnp.isfinite(norm)
    return jax.tree_util.tree_map(lambda n, o: jnp.where(ok, n, o), new, old)


def update(jnp, rule, grads, sum_squares: Callable[[Any], Any], apply: Callable[[Any], Any],
           old: Any, scalars: Any) -> tuple[Any, Any]:
    """``(new state, norm)``: ``apply(clipped grads)`` returns the new state (a tree shaped
    like ``old``: parameters, optimizer state and whatever else a skipped step keeps), under
    ``rule`` (``adapters._update.UpdateRule``: its ``clip`` and ``skip``). ``sum_squares(g)``
    adds up the squares of the whole gradient ``g`` (a zero stands for the norm unless
    ``rule.needs_norm``). Under a loss scaler (fp16), ``grads`` are those of the loss times the
    step's scale (``scalars``'): unscaled first (exactly: a power of two), so the norm, clip and
    update see the true ones. With :class:`Deferred` ``scalars`` the norm's place holds the
    step's :class:`Report`, its counters advanced on the device."""
    scale = step_scalars(scalars).loss_scale
    if rule.scaler is not None:
        import jax

        inverse = 1.0 / scale
        grads = jax.tree_util.tree_map(lambda g: g * inverse.astype(g.dtype), grads)
    grads, norm = clip_by_norm(jnp, grads, lambda: sum_squares(grads), rule.clip, rule.skip)
    new = apply(grads)
    new = keep_if_finite(jnp, norm, new, old) if rule.skip else new
    if not isinstance(scalars, Deferred):
        return new, norm
    finite = jnp.isfinite(norm)
    return new, Report(norm, advance(jnp, rule.scaler, scalars.counters, finite), ~finite, scale)
