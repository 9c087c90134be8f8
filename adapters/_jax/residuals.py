"""The activations a JAX pipeline piece's forward program keeps for its backward program.

A piece's forward and backward are separate compiled programs (``adapters._jax.programs``).
Without activation checkpointing the forward hands the backward what ``jax.vjp`` would keep
between the two (the residuals), so the backward does not run the forward again: the
executor holds them per micro-batch in flight, as autograd holds its saved tensors.

Not every residual is worth holding. Of the leaves of the piece's vjp:

- those that depend on the parameters only (a weight, its 16-bit cast under mixed
  precision) the backward program computes again: cheap, and held once per micro-batch
  they would multiply the stage's parameter bytes by the micro-batches in flight;
- those that are an input of the piece (its activation, which the box still holds, the
  labels, its model state or its dropout key) the backward program reads as it does when it
  recomputes;
- the rest (products, nonlinearities, softmax probabilities: what depends on the input) are
  kept.

Which leaf is which comes from the traced program itself (:func:`kept_leaves`): a leaf is kept
when it is computed from the piece's input or labels. The backward program traces the same
vjp, replaces the kept leaves with the forward's, and XLA removes the forward work whose
results are then unused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def kept_leaves(jax, f: Callable, params: Any, h: Any, rest: tuple) -> list[bool]:
    """For each leaf of ``jax.vjp(lambda p, h: f(p, h, *rest), params, h, has_aux=True)``'s
    vjp function (``f`` returns its output and, as the auxiliary value, its new model state):
    whether it is computed from ``h`` or ``rest`` (and is not one of them)."""
    def struct(t):
        return jax.ShapeDtypeStruct(t.shape, t.dtype)

    def leaves(p, hh, *r):
        return jax.tree_util.tree_leaves(jax.vjp(lambda a, b: f(a, b, *r), p, hh,
                                                 has_aux=True)[1])

    closed = jax.make_jaxpr(leaves)(*jax.tree_util.tree_map(struct, (params, h, *rest)))
    jaxpr, n_params = closed.jaxpr, len(jax.tree_util.tree_leaves(params))
    varying = _depends(jaxpr, [i >= n_params for i in range(len(jaxpr.invars))])
    inputs = set(map(id, jaxpr.invars))
    return [bool(v) and id(out) not in inputs for v, out in zip(varying, jaxpr.outvars,
                                                                  strict=True)]


def _depends(jaxpr, varying_in: list[bool]) -> list[bool]:
    """Which outputs of ``jaxpr`` depend on its inputs marked in ``varying_in``. A call of an
    inner program (``pjit``, a custom derivative's) is followed inside; any other equation's
    outputs depend on whatever its inputs do."""
    varying = {id(v) for v, on in zip(jaxpr.invars, varying_in, strict=True) if on}

    def on(v) -> bool:
        return id(v) in varying and not hasattr(v, "val")  # (a Literal has a value)

    for eqn in jaxpr.eqns:
        flags = [on(v) for v in eqn.invars]
        if not any(flags):
            continue
        inner = _inner(eqn)
        outs = (_depends(inner, flags) if inner is not None and len(inner.invars) == len(flags)
                else [True] * len(eqn.outvars))
        varying.update(id(v) for v, o in zip(eqn.outvars, outs, strict=True) if o)
    return [on(v) for v in jaxpr.outvars]


def _inner(eqn):
    """The program an equation calls (its ``jaxpr`` or ``call_jaxpr``), or None."""
    for name in ("jaxpr", "call_jaxpr"):
        inner = eqn.params.get(name)
        if inner is not None:
            return getattr(inner, "jaxpr", inner)  # (a ClosedJaxpr's)
    return None


class Residuals:
    """Per piece, the vjp of ``f(params, h, *rest) -> (output, aux)`` split once into the
    leaves the forward keeps and those the backward computes again (see the module docstring);
    with ``recompute`` the forward keeps none and the backward computes every one."""

    def __init__(self, jax, recompute: bool = False):
        self.jax, self.recompute, self.kept = jax, recompute, {}

    def _mask(self, k: int, f, params, h, rest) -> list[bool]:
        if k not in self.kept:
            self.kept[k] = kept_leaves(self.jax, f, params, h, rest)
        return self.kept[k]

    def forward(self, k: int, f: Callable, params, h, *rest) -> tuple[Any, Any, list]:
        """``(f's output, its aux, the leaves kept for the backward)`` of piece ``k``."""
        if self.recompute:
            return (*f(params, h, *rest), [])
        out, vjp, aux = self.jax.vjp(lambda a, b: f(a, b, *rest), params, h, has_aux=True)
        mask = self._mask(k, f, params, h, rest)
        return out, aux, [leaf for leaf, keep in zip(self.jax.tree_util.tree_leaves(vjp), mask,
                                                     strict=True) if keep]

    def backward(self, k: int, f: Callable, params, h, rest: tuple, kept: list, cotangent):
        """``(d params, d h)`` of piece ``k`` from the forward's ``kept`` leaves."""
        tree_util = self.jax.tree_util
        _, vjp, _ = self.jax.vjp(lambda a, b: f(a, b, *rest), params, h, has_aux=True)
        if self.recompute:
            return vjp(cotangent)
        leaves, tree = tree_util.tree_flatten(vjp)
        given = iter(kept)
        mixed = [next(given) if keep else leaf
                 for leaf, keep in zip(leaves, self._mask(k, f, params, h, rest), strict=True)]
        return tree_util.tree_unflatten(tree, mixed)(cotangent)
