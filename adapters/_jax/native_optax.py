"""The user's own optax transformation under the JAX backends' sharded and pipeline layouts.

A sharded layout (ZeRO 1-3) updates each device's flat shards of the parameters
(``adapters._jax.flat_units.FlatUnits``); a pipeline stage updates its own flat vector
(``adapters._jax.stages.StagedModel``). A transformation gives the data-parallel result there
only when it is *elementwise*: every element's update depends on that element's gradient,
parameter and state, and on scalars (step counts, schedules). One that reads a whole tensor or
the tree's structure (``clip_by_global_norm``, ``lamb``'s trust ratio, ``adafactor``'s factored
moments and parameter scale, a weight-decay mask) would see only a part of it, so
:func:`check_elementwise` runs it on the whole tree and on the parts, and refuses it unless the
two agree.

The state keeps the data-parallel layout's checkpoint names (``JaxStrategy._optax_leaves``:
``opt/<tree path>``): a per-parameter leaf (``mu``, ``nu``: a subtree shaped like what the
transformation updates) is written per parameter, ``opt/<path to the subtree>.<parameter's
path>``, and every other leaf (``count``) is replicated under its own path. A run resumes onto
any layout or world size with the same transformation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from adapters._jax.flat_units import FlatUnits
from adapters._jax.update import is_native
from toolkit import GPT, SGD, Adam, ToolkitError
from toolkit.models.reference import optimizer_slots
from toolkit.models.specs import ModelSpec

#: What works, in every refusal.
HINT = ("use an elementwise transformation (optax.sgd, adam, adamw, rmsprop, adagrad, lion, ... "
        "with an optax schedule as the learning rate, weight decay unmasked), and "
        "Trainer(clip_grad_norm=...) instead of clip_by_global_norm (the toolkit clips by the "
        "global norm across shards and stages); or the data-parallel layout")


def check_sharded_optimizer(backend: str, optimizer: Any) -> None:
    """Sharded layouts update flat shards with the toolkit's optimizers or an optax
    transformation (which must be elementwise: ``adapters._jax.native_optax``, at build)."""
    if not isinstance(optimizer, SGD | Adam) and not is_native(optimizer):
        raise ToolkitError(
            f"{backend} cannot shard the optimizer {type(optimizer).__name__}: a sharded "
            "layout updates flat shards with an elementwise optimizer",
            "pass toolkit.SGD(...), toolkit.Adam(...) or an elementwise optax transformation")


def check_elementwise(backend: str, layout: str, tx: Any, init: dict[str, Any],
                      paths: dict[str, tuple[str, ...]],
                      cut: Callable[[dict[str, np.ndarray]], list[Any]],
                      join: Callable[[list[Any]], dict[str, np.ndarray]]) -> None:
    """Refuses ``tx`` with a ToolkitError unless it is elementwise (module docstring).

    ``tx`` runs ``init`` and two updates on the parameter tree the data-parallel layout gives
    it (``init``: neutral name -> parameter, for the shapes and dtype; ``paths``: each name's
    path in that tree) filled with random numbers, and on the same numbers as ``cut`` makes them
    (neutral name -> array, to the list of what each device updates), each part on its own;
    ``join`` puts the parts' updates back together by neutral name. Any difference beyond
    rounding, or an exception, refuses it.

    Cost: the parameters, two gradients and the transformation's state, twice over (the tree
    and its parts) in host memory, and two updates run op by op: milliseconds at test sizes,
    seconds and a few times the model's bytes for a large one.
    """
    import jax
    import optax
    from flax import traverse_util

    names = [n for n in init if np.issubdtype(np.asarray(init[n]).dtype, np.floating)]
    if not names:
        return
    dtype = np.result_type(*[np.asarray(init[n]).dtype for n in names])
    shapes = [np.shape(init[n]) for n in names]
    offsets = np.cumsum([0, *[int(np.prod(s)) for s in shapes]])
    # Every element its own scale (a ramp across the whole model, so that each part of it, a
    # shard or a stage, has its norms in other proportions than the whole's).
    ramp = np.logspace(-1, 1, int(offsets[-1]))
    rng = np.random.default_rng(0)

    def draw(power):
        return {n: (rng.standard_normal(shape) * ramp[a:b].reshape(shape) ** power).astype(dtype)
                for n, shape, a, b in zip(names, shapes, offsets[:-1], offsets[1:], strict=True)}

    # parameters 1e-3 to 1e3 (a masked weight decay then shows), then two gradients
    values = [draw(p) for p in (3, 0, 2)]
    name_of = {tuple(paths[n]): n for n in names}
    eps = np.finfo(dtype).eps

    def run(tx, p, g1, g2):
        state, out = tx.init(p), []
        for g in (g1, g2):
            updates, state = tx.update(g, state, p)
            p = optax.apply_updates(p, updates)
            out.append(jax.tree_util.tree_map(np.asarray, updates))
        return out

    def differs(tx) -> str | None:
        """Why ``tx`` is not elementwise (None: it is)."""
        trees = [traverse_util.unflatten_dict({tuple(paths[n]): a for n, a in v.items()})
                 for v in values]
        whole = [{name_of[k]: u for k, u in traverse_util.flatten_dict(t).items()}
                 for t in run(tx, *trees)]  # (an error here is the transformation's own)
        try:
            parts = [run(tx, *part) for part in zip(*(cut(v) for v in values), strict=True)]
            joined = [join([p[i] for p in parts]) for i in range(2)]
        except Exception as err:  # e.g. a mask built for the parameter tree's structure
            return f"there it fails ({type(err).__name__}: {str(err)[:200]})"
        for step, (ref, got) in enumerate(zip(whole, joined, strict=True)):
            for name, expected in ref.items():
                expected, value = (np.asarray(a, np.float64) for a in (expected, got[name]))
                diff = np.abs(value - expected)
                # rounding: a few units in the last place of the element, or of the tensor's
                # largest (for elements near zero); a non-finite result alike in both passes
                bound = 64 * eps * (np.abs(expected) + np.max(np.abs(expected), initial=0) / 16)
                same = (diff <= bound) | (np.isnan(expected) & np.isnan(value)) | (
                    expected == value)
                if not np.all(same):
                    return (f"there its update {step + 1} of {name!r} differs from the whole "
                            f"tree's by up to {float(np.max(diff)):.3g}")
        return None

    reason = differs(tx)
    if reason is None:
        return
    parts = _parts(tx)
    culprits = [_factory(p) for p in parts if len(parts) > 1 and differs(p) is not None]
    raise ToolkitError(
        f"{backend} cannot run the optax transformation {_describe(tx)} under a {layout} "
        f"layout: each device updates only its part of the parameters, and {reason}: "
        f"{' and '.join(culprits) or 'it'} reads a whole tensor or the tree's structure (as "
        "clip_by_global_norm, lamb's scale_by_trust_ratio, adafactor's block RMS and a masked "
        "weight decay do)", HINT)


def _closure(fn: Any) -> dict[str, Any]:
    import inspect

    try:
        return dict(inspect.getclosurevars(fn).nonlocals)
    except TypeError:  # not a Python function
        return {}


def _unwrapped(tx: Any) -> Any:
    """``tx`` without optax's extra-arguments wrapper (``with_extra_args_support``)."""
    import optax

    inner = _closure(tx.update).get("tx")
    return _unwrapped(inner) if isinstance(inner, optax.GradientTransformation) else tx


def _factory(tx: Any) -> str:
    """The optax function that made ``tx`` (``scale_by_adam``, ``clip_by_global_norm``)."""
    qual = getattr(_unwrapped(tx).update, "__qualname__", "")
    return qual.split(".<locals>")[0] if ".<locals>" in qual else type(tx).__name__


def _parts(tx: Any) -> list[Any]:
    """The transformations an ``optax.chain`` is made of (nested chains too), else ``[tx]``."""
    import optax

    tx = _unwrapped(tx)
    inits, updates = _closure(tx.init).get("init_fns"), _closure(tx.update).get("update_fns")
    if _factory(tx) != "chain" or not inits or len(inits) != len(updates or ()):
        return [tx]
    return [part for i, u in zip(inits, updates, strict=True)
            for part in _parts(optax.GradientTransformation(i, u))]


def _describe(tx: Any) -> str:
    """``tx`` by the optax functions that made it: ``chain(clip_by_global_norm, ...)``."""
    parts = _parts(tx)
    names = [_factory(p) for p in parts]
    return names[0] if len(parts) == 1 else f"chain({', '.join(names)})"


def tree_path(model: Any, name: str) -> tuple[str, ...]:
    """A neutral parameter name's path in the data-parallel layout's parameter tree
    (``adapters._jax.models.spec.JaxModel``'s: ``layers.0.kernel`` -> ``layers_0, kernel``)."""
    if isinstance(model, GPT):
        from adapters._jax.models.gpt import path_of  # (its module imports Flax)

        return path_of(name)
    if isinstance(model, ModelSpec):
        *module, leaf = name.split(".")
        return ("_".join(module), leaf)
    return tuple(name.split("."))


# ------------------------------------------------------------------ the state and its names
def per_parameter(like: Any) -> Callable[[Any], bool]:
    """Whether a node of an optax state is per-parameter: a subtree shaped like ``like`` (what
    the transformation updates: a layout's store of flat buffers, or the parameter tree)."""
    import jax

    treedef = jax.tree_util.tree_structure(like)
    if treedef.num_nodes == 1:  # one array (a stage's flat vector): an array of its shape
        shape = np.shape(like)
        return lambda x: hasattr(x, "shape") and tuple(x.shape) == shape
    return lambda x: jax.tree_util.tree_structure(x) == treedef


def convert(state: Any, is_param: Callable[[Any], bool], param: Callable[[Any], Any],
            other: Callable[[Any], Any]) -> Any:
    """``state`` with each per-parameter node ``x`` replaced by ``param(x)`` and every other
    leaf by ``other(x)`` (the same outer structure: e.g. shards -> the parameter tree)."""
    import jax

    return jax.tree_util.tree_map(lambda x: param(x) if is_param(x) else other(x), state,
                                  is_leaf=is_param)


def entries(state: Any, is_param: Callable[[Any], bool]) -> list[tuple[str, Any, bool]]:
    """``(name, node, per_parameter)`` for the nodes of ``state``: a per-parameter node's name
    is the prefix of its parameters' names (:func:`param_key`), any other leaf's its own."""
    import jax

    keystr = jax.tree_util.keystr
    return [("opt/" + keystr(path, simple=True, separator="."), node, is_param(node))
            for path, node in jax.tree_util.tree_flatten_with_path(state, is_leaf=is_param)[0]]


def param_key(prefix: str, path: tuple[str, ...]) -> str:
    """The name of one parameter's leaf under a per-parameter node named ``prefix``: its name
    in the data-parallel layout (``opt/0.mu`` + ``layers_0.kernel``)."""
    return prefix + ("." if prefix != "opt/" else "") + ".".join(map(str, path))


def model_paths(model: Any) -> dict[str, tuple[str, ...]]:
    """Neutral name -> path in the parameter tree of a ``JaxModel``."""
    return {model.name_of(k): k for k in model.traverse.flatten_dict(model.params)}


# ------------------------------------------------------------------ sharded layouts
class ShardedOptax:
    """A native optax state over a sharded layout's store of flat buffers (``{unit: flat}``,
    jax-pjit's ``{"units": ..., "split": ...}``), in the conversions both JAX backends share.

    Args:
        model: the ``JaxModel``.
        store: the layout's parameter store (any leaves: only its structure counts).
        local: a backend's device -> host copy of a replicated tree (``_local``/``_host``).
        replicate: its host -> device copy of a replicated tree (``_replicate``).
    """

    def __init__(self, model: Any, store: Any, local: Callable, replicate: Callable):
        self.model, self.local, self.replicate = model, local, replicate
        self.is_store, self.is_tree = per_parameter(store), per_parameter(model.params)
        self.paths = model_paths(model)

    def to_tree(self, state: Any, named: Callable[[Any], dict[str, np.ndarray]]) -> Any:
        """The data-parallel layout's host state (``named(store)``: gathered, by name)."""
        return convert(state, self.is_store,
                       lambda s: self.model.unflat(named(s), self.model.params), self.local)

    def like(self, state: Any) -> Any:
        """The data-parallel layout's state as ``JaxStrategy._import`` takes it (its leaves
        give the dtypes)."""
        return convert(state, self.is_store, lambda s: self.model.params, self.local)

    def from_tree(self, tree_state: Any, place: Callable[[dict[str, np.ndarray]], Any]) -> Any:
        """The layout's state from the data-parallel one (``place(named)``: a placed store)."""
        return convert(tree_state, self.is_tree, lambda t: place(self.model.flat(t)),
                       self.replicate)

    def shardings(self, shapes: Any, store: Any, other: Any) -> Any:
        """The shardings of a state shaped ``shapes`` (``jax.eval_shape`` of ``init``): each
        per-parameter store as ``store``, every other leaf ``other`` (replicated)."""
        return convert(shapes, self.is_store, lambda _: store, lambda _: other)

    def stores(self, state: Any) -> tuple[dict[str, np.ndarray], list[tuple[Callable, Any]]]:
        """``(replicated, [(key, store)])`` for a checkpoint: the other leaves by name, and
        each per-parameter store with ``key(neutral name)``, its parameters' names."""
        replicated, stores = {}, []
        for name, node, per in entries(state, self.is_store):
            if per:
                stores.append((lambda n, prefix=name: param_key(prefix, self.paths[n]), node))
            else:
                replicated[name] = self.local(node)
        return replicated, stores


def check_sharded(backend: str, layout: Any, tx: Any, model: Any) -> None:
    """:func:`check_elementwise` with the flat units cut in two shards, as two devices would
    update them."""
    units = FlatUnits(model, 2)

    def cut(named):
        flats = units.flatten(named)
        return [{u: f[i * len(f) // 2:(i + 1) * len(f) // 2] for u, f in flats.items()}
                for i in range(2)]

    def join(parts):
        return units.named({u: np.concatenate([p[u] for p in parts]) for u in parts[0]})

    check_elementwise(backend, layout.name, tx, model.flat(model.params), model_paths(model),
                      cut, join)


# ------------------------------------------------------------------ pipeline stages
class StageOptimizer:
    """The optimizer state of a pipeline's stages and its checkpoint names: a spec's slots
    ``{slot: (S, L)}`` (each stage's flat vector of each slot), or a native optax state run on
    each stage's flat vector (per-parameter leaves ``(S, L)``, every other leaf one per stage);
    held stacked over the stages on the host, over the devices once placed.

    Args:
        backend: its name. layout: the ``toolkit.Pipeline``. optimizer: the build's.
        tx: its optax transformation (``make_optimizer``). staged: the ``StagedModel``.
        model: the model the build got (its parameters' paths in the data-parallel tree).
    """

    def __init__(self, backend: str, layout: Any, optimizer: Any, tx: Any, staged: Any,
                 model: Any):
        self.tx, self.staged, self.native = tx, staged, is_native(optimizer)
        self.paths = {n: tree_path(model, n) for n in staged.names()}
        length = (staged.length,)
        self.is_param = lambda x: tuple(getattr(x, "shape", ())[1:]) == length
        self.slots = () if self.native else optimizer_slots(optimizer)
        if not self.native:
            return

        def cut(named):  # each stage its flat vector
            return list(staged.flatten(named, np.asarray(next(iter(named.values()))).dtype))

        check_elementwise(backend, layout.name, tx, staged.init, self.paths, cut,
                          lambda parts: staged.unflatten(np.stack(parts)))

    def init(self, params: np.ndarray) -> Any:
        """The initial state (host) for the ``(S, L)`` parameters ``params``."""
        import jax

        if not self.native:
            return {s: np.zeros_like(params) for s in self.slots}
        states = [self.tx.init(row) for row in params]
        return jax.tree_util.tree_map(lambda *rows: np.stack([np.asarray(r) for r in rows]),
                                      *states)

    def stores(self, state: Any) -> tuple[dict[str, np.ndarray], list[tuple[Callable, Any]]]:
        """``(replicated, [(key, stacked)])``: the leaves one per stage (a native state's
        counts: the same on every stage) by name, and each per-parameter ``(S, L)`` array with
        ``key(neutral name)``, its parameters' names."""
        if not self.native:
            return {}, [(lambda n, s=slot: f"opt/{s}/{n}", state[slot]) for slot in self.slots]
        replicated, stacked = {}, []
        for name, node, per in entries(state, self.is_param):
            if per:
                stacked.append((lambda n, prefix=name: param_key(prefix, self.paths[n]), node))
            else:  # this process's first device's stage: its value
                replicated[name] = np.asarray(node.addressable_data(0)).reshape(node.shape[1:])
        return replicated, stacked

    def named(self, state: Any, full: Callable[[Any], np.ndarray]) -> dict[str, np.ndarray]:
        """The state under the checkpoint's names, whole (``full(stacked)``: the ``(S, L)``
        array on the host)."""
        replicated, stacked = self.stores(state)
        for key, array in stacked:
            replicated.update({key(n): v for n, v in self.staged.unflatten(full(array)).items()})
        return replicated

    def load(self, state: dict[str, np.ndarray], dtype: str, like: Any) -> Any:
        """The host state (as :meth:`init` makes it) from the checkpoint's ``state``, shaped
        like the placed state ``like``."""
        import jax

        names, S = self.staged.names(), self.staged.stages
        if not self.native:
            return {s: self.staged.flatten({n: state[f"opt/{s}/{n}"] for n in names}, dtype)
                    for s in self.slots}
        leaves = []
        for name, node, per in entries(like, self.is_param):
            if per:
                leaves.append(self.staged.flatten(
                    {n: state[param_key(name, self.paths[n])] for n in names}, node.dtype))
            else:
                value = np.asarray(state[name], node.dtype).reshape(node.shape[1:])
                leaves.append(np.stack([value] * S))
        return jax.tree_util.tree_unflatten(
            jax.tree_util.tree_structure(like, is_leaf=self.is_param), leaves)
