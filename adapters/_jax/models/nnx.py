"""Flax NNX modules in the JAX backends: an ``nnx.Module`` behind the ``apply`` of a Linen
module, which is what the backends' steps call.

NNX keeps a module's variables inside the object; the backends' compiled steps take them as
arguments. :class:`NnxModule` splits the module once (``nnx.split``) into its graph and three
kinds of state: parameters (``nnx.Param``), its random streams (``nnx.RngState``: a Dropout's
key and count) and the rest (``nnx.BatchStat`` and any other variable: the model state,
checkpointed under ``buffers/state/<path>``). ``apply`` merges parameters and state into a
fresh module (``nnx.merge``) inside the step, switches it the NNX way (``Module.train()`` or
``Module.eval()``: Dropout's ``deterministic``, BatchNorm's ``use_running_average``), calls it,
and for a training step returns the new model state. The random streams are drawn anew each
training step from the backends' (seed, step) key, as a Linen module's ``dropout`` stream is,
so a run and its resume draw the same masks; the module's own stream state is never carried.
"""

from __future__ import annotations

from typing import Any


def is_nnx(model: Any) -> bool:
    """Whether ``model`` is a Flax NNX module (``flax.nnx.Module``)."""
    try:
        from flax import nnx
    except ImportError:  # a Flax without NNX
        return False
    return isinstance(model, nnx.Module)


class NnxModule:
    """An ``nnx.Module`` with the Linen ``apply`` signature the JAX backends call.

    Example:
        >>> from flax import nnx
        >>> m = NnxModule(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
        >>> sorted(m.variables()["params"])
        ['bias', 'kernel']
    """

    def __init__(self, model: Any, first_stream: int = 0):
        from flax import nnx

        self.nnx, self.name = nnx, type(model).__name__
        self.graphdef, self.params, self.streams, self.rest = nnx.split(
            model, nnx.Param, nnx.RngState, ...)
        # A layer a pipeline runs by itself numbers its streams after those of the layers
        # before it, so each draws the key it draws in the whole model (see ``_drawn``).
        self.first_stream = first_stream

    @property
    def stream_count(self) -> int:
        """How many random streams (keys) the module holds."""
        import jax
        from flax import traverse_util

        return sum(jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key) for v in
                   traverse_util.flatten_dict(self.nnx.to_pure_dict(self.streams)).values())

    def variables(self) -> dict[str, Any]:
        """``{"params": ..., "state": ...}`` as nested dicts of arrays (``state`` only when
        the module has model state), as a Linen module's ``init`` returns its collections."""
        to_pure = self.nnx.to_pure_dict
        out = {"params": to_pure(self.params)}
        rest = to_pure(self.rest)
        return {**out, "state": rest} if rest else out

    def apply(self, variables: dict[str, Any], x: Any, *, train: bool = False,
              rngs: dict[str, Any] | None = None, mutable: Any = False) -> Any:
        """The module's output on ``x`` with ``variables``' parameters and state; with
        ``mutable``, ``(output, {"state": new state})``. ``rngs["dropout"]``: the key every
        random stream of a training step is drawn from."""
        nnx = self.nnx
        streams = self.streams
        if train and rngs and rngs.get("dropout") is not None:
            streams = _drawn(self.streams, rngs["dropout"], self.first_stream)
        model = nnx.merge(self.graphdef, _filled(self.params, variables["params"]), streams,
                          _filled(self.rest, variables.get("state", {})))
        if train:
            model.train()
        else:
            model.eval()
        out = model(x)
        if not mutable:
            return out
        rest = nnx.to_pure_dict(nnx.split(model, nnx.Param, nnx.RngState, ...)[3])
        return out, ({"state": rest} if rest else {})


def _filled(template: Any, pure: dict[str, Any]) -> Any:
    """A copy of the ``nnx.State`` ``template`` holding ``pure``'s arrays (the template stays
    as it is: under ``jit`` the arrays are tracers)."""
    import jax
    from flax import nnx

    state = jax.tree_util.tree_map(lambda a: a, template)
    if pure:
        nnx.replace_by_pure_dict(state, pure)
    return state


def _drawn(streams: Any, key: Any, first: int = 0) -> Any:
    """``streams`` (the module's ``nnx.RngState``) with every stream's key drawn from ``key``
    (the i-th stream's: ``fold_in(key, first + i)``) and its count at 0."""
    import jax
    from flax import nnx, traverse_util

    if not jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)
    flat = traverse_util.flatten_dict(nnx.to_pure_dict(streams))
    fresh, i = {}, first
    for path, value in flat.items():
        if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
            fresh[path], i = jax.random.fold_in(key, i), i + 1
        else:
            fresh[path] = jax.numpy.zeros_like(value)
    return _filled(streams, traverse_util.unflatten_dict(fresh))
