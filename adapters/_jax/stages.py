"""Pipeline stages for the JAX backends: a model cut into pieces, held as flat vectors.

A model is cut into ``K = S x v`` *pieces* (``toolkit.partition_model`` for spec models; a list
of ``(flax module, variables)`` pairs cut by index for native ones); piece ``k`` runs on stage
``k % S`` as its local chunk ``k // S``. Each stage holds its parameters as **one flat vector**
(every stage's padded to the longest, so the stages stack into an ``(S, L)`` array sharded over
the ``stage`` axis); the optimizer is elementwise (the toolkit's arithmetic, or an optax
transformation ``adapters._jax.native_optax`` checked), so it runs on the flat vectors directly
(padding has a zero gradient, and no parameter reads it). A parameter held by two stages
(the tied GPT ``tok_emb``: embedding on the first stage, head on the last) comes first in both
holders' vectors, so one masked ``psum`` over the stage axis sums its gradients.

A native model's **state** (every Flax collection besides ``params``: BatchNorm's
``batch_stats``, an NNX module's ``nnx.BatchStat``) is held the same way, in a second flat
vector per stage: each layer's state on the stage that runs it, under data parallelism's
checkpoint names (``buffers/<collection>/<path>``). A piece is
``fn(params, h, state, rng, train) -> (out, new state)``: a training forward returns its
layers' updated state (``mutable=``), an evaluation uses the running averages.

The schedule's rounds are in ``rounds.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from typing import Any

import numpy as np

from toolkit import ToolkitError
from toolkit.models.specs import CNN, MLP, ModelSpec
from toolkit.parallel.pipeline.partition import partition_layers, partition_model

_NATIVE_HINT = ("pass a toolkit.MLP/GPT spec, a (flax.linen.Sequential, variables) pair, an "
                "nnx.Sequential, or a list of (flax module, variables) pairs applied in order "
                "(each variables = module.init(key, x))")

Table = dict[str, tuple[int, tuple[int, ...]]]  # name -> (offset, shape) in a flat vector


def _flatten(tables: list[Table], length: int, named: dict[str, np.ndarray],
             dtype: str) -> np.ndarray:
    out = np.zeros((len(tables), length), dtype)
    for s, table in enumerate(tables):
        for name, (off, shape) in table.items():
            out[s, off:off + math.prod(shape)] = np.asarray(named[name]).reshape(-1)
    return out


def _unflatten(tables: list[Table], flat: np.ndarray) -> dict[str, np.ndarray]:
    named: dict[str, np.ndarray] = {}
    for s, table in enumerate(tables):
        for name, (off, shape) in table.items():
            if name not in named:
                named[name] = np.array(flat[s, off:off + math.prod(shape)]).reshape(shape)
    return named


def _sliced(flat, table: Table, names) -> dict[str, Any]:
    return {n: flat[table[n][0]:table[n][0] + math.prod(table[n][1])].reshape(table[n][1])
            for n in names}


@dataclasses.dataclass
class StagedModel:
    """A model cut into pieces, and each stage's flat parameter and state layouts.

    Attributes:
        stages, chunks: ``S`` and ``v``.
        fns: per piece, ``fn(params_by_name, h, state_by_name, rng, train) -> (h, state)``
            (the last piece's ``h`` is the outputs; ``rng``: the micro-batch's dropout key).
        piece_names: per piece, the parameter names it uses.
        stage_names: per stage, the names in its flat vector, in order (shared names first).
        offsets: per stage, name -> (offset, shape) in its flat vector.
        length: the flat vectors' common (padded) length.
        shared: name -> stages holding it (more than one).
        n_shared: elements at the front of each holder's vector that belong to shared names.
        init: name -> initial array (numpy).
        state_names: per piece, the model state it reads and (training) updates, by name
            (``batch_stats/layers_1.mean``: the checkpoint's ``buffers/...`` without the
            prefix); a name belongs to one piece.
        state_offsets: per stage, state name -> (offset, shape) in its flat state vector.
        state_length: the flat state vectors' common length (at least 1: a model without state
            carries one unused element, so every program has the same arguments).
        state_init: state name -> initial array (numpy).
    """

    stages: int
    chunks: int
    fns: list
    piece_names: list[tuple[str, ...]]
    stage_names: list[tuple[str, ...]]
    offsets: list[Table]
    length: int
    shared: dict[str, tuple[int, ...]]
    n_shared: int
    init: dict[str, np.ndarray]
    state_names: list[tuple[str, ...]] = dataclasses.field(default_factory=list)
    state_offsets: list[Table] = dataclasses.field(default_factory=list)
    state_length: int = 1
    state_init: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

    @property
    def pieces(self) -> int:
        return len(self.fns)

    @property
    def has_state(self) -> bool:
        """Whether any piece carries model state (BatchNorm statistics)."""
        return bool(self.state_init)

    def stage_of(self, piece: int) -> int:
        return piece % self.stages

    def holders_mask(self) -> np.ndarray:
        """1.0 for the stages that hold the shared names, else 0.0."""
        holders = {s for stages in self.shared.values() for s in stages}
        return np.asarray([1.0 if s in holders else 0.0 for s in range(self.stages)])

    def flatten(self, named: dict[str, np.ndarray], dtype: str) -> np.ndarray:
        """Full tensors by name -> the ``(S, length)`` stack of stage vectors."""
        return _flatten(self.offsets, self.length, named, dtype)

    def unflatten(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """The ``(S, length)`` stack -> full tensors by name (a shared one from its first
        holder)."""
        return _unflatten(self.offsets, flat)

    def flatten_state(self, named: dict[str, np.ndarray], dtype: str) -> np.ndarray:
        """Model state by name -> the ``(S, state_length)`` stack of stage state vectors."""
        return _flatten(self.state_offsets, self.state_length, named, dtype)

    def unflatten_state(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """The ``(S, state_length)`` stack -> model state by name."""
        return _unflatten(self.state_offsets, flat)

    def owner_stage(self, name: str) -> int:
        """The one stage whose copy of ``name`` (a parameter or a state name) a checkpoint
        stores."""
        return next(s for s in range(self.stages)
                    if name in self.offsets[s] or name in self.state_offsets[s])

    def names(self) -> list[str]:
        """Every parameter name once, in the model's order."""
        seen: dict[str, None] = {}
        for names in self.piece_names:
            seen.update(dict.fromkeys(names))
        return list(seen)

    def state_names_all(self) -> list[str]:
        """Every state name once, in the model's order."""
        return [n for names in self.state_names for n in names]

    def piece_params(self, flat, piece: int) -> dict[str, Any]:
        """Piece ``piece``'s parameters sliced (statically) out of its stage's flat vector, or
        picked from a dict of the stage's parameters by name (:meth:`stage_params`)."""
        if isinstance(flat, dict):
            return {n: flat[n] for n in self.piece_names[piece]}
        return _sliced(flat, self.offsets[self.stage_of(piece)], self.piece_names[piece])

    def piece_state(self, flat, piece: int) -> dict[str, Any]:
        """Piece ``piece``'s model state sliced out of its stage's flat state vector (1-D)."""
        return _sliced(flat, self.state_offsets[self.stage_of(piece)], self.state_names[piece])

    def with_state(self, flat, piece: int, state: dict[str, Any]):
        """The stage's flat state vector (1-D) with piece ``piece``'s entries replaced by
        ``state``'s (cast to the vector's dtype)."""
        table = self.state_offsets[self.stage_of(piece)]
        for n in self.state_names[piece]:
            off = table[n][0]
            flat = flat.at[off:off + math.prod(table[n][1])].set(
                state[n].reshape(-1).astype(flat.dtype))
        return flat

    def stage_params(self, flat, stage: int) -> dict[str, Any]:
        """Every parameter of ``stage`` by name, sliced out of its flat vector (traced: a copy
        each, made once per step rather than by every action that reads them)."""
        flat = flat.reshape(-1)
        return {n: flat[off:off + math.prod(shape)].reshape(shape)
                for n, (off, shape) in self.offsets[stage].items()}
    def add_grads(self, flat, piece: int, grads: dict[str, Any]):
        """``flat`` plus piece ``piece``'s gradients at their offsets (on its last axis), as
        one add of a whole vector (zeros elsewhere): XLA makes it one pass in place, where an
        add per parameter, or one over part of the vector, rewrote the whole vector each time
        (measured at the pipeline benchmark's MLP: 20-25 ms a backward, now 3)."""
        import jax.numpy as jnp

        offsets = self.offsets[self.stage_of(piece)]
        parts, end = [], 0
        for off, name in sorted((offsets[n][0], n) for n in grads):
            if off > end:
                parts.append(jnp.zeros(off - end, flat.dtype))
            parts.append(grads[name].reshape(-1).astype(flat.dtype))
            end = off + math.prod(offsets[name][1])
        if end < flat.shape[-1]:
            parts.append(jnp.zeros(flat.shape[-1] - end, flat.dtype))
        return flat + jnp.concatenate(parts)



def _tables(S: int, K: int, names_of: list[tuple[str, ...]], init: dict[str, np.ndarray],
            first: dict[str, Any]) -> tuple[list[tuple[str, ...]], list[Table], list[int]]:
    """Per stage: its names in order (``first``'s first), their offsets, and its length."""
    stage_names, offsets, lengths = [], [], []
    for s in range(S):
        names: dict[str, None] = {}
        for k in range(s, K, S):
            names.update(dict.fromkeys(names_of[k]))
        front = [n for n in first if n in names]
        ordered = tuple(front + [n for n in names if n not in front])
        table, off = {}, 0
        for n in ordered:
            shape = tuple(np.shape(init[n]))
            table[n] = (off, shape)
            off += math.prod(shape)
        stage_names.append(ordered)
        offsets.append(table)
        lengths.append(off)
    return stage_names, offsets, lengths


def stage_model(model: Any, layout: Any, seed: int, dtype: str, backend: str) -> StagedModel:
    """``model`` (a toolkit.MLP/GPT spec or a native sequential model: :func:`_native_layers`)
    cut as ``layout`` (a ``toolkit.Pipeline``) says."""
    S, v = layout.stages, layout.chunks
    splits = layout.splits or None
    state_init: dict[str, np.ndarray] = {}
    if isinstance(model, ModelSpec):
        if isinstance(model, CNN):
            raise ToolkitError(f"{backend} cannot cut the CNN spec into pipeline stages",
                               "use toolkit.MLP or toolkit.GPT with a pipeline layout")
        part = partition_model(model, S, v, splits)
        init = {n: np.asarray(a).astype(dtype) if np.issubdtype(np.asarray(a).dtype, np.floating)
                else np.asarray(a) for n, a in model.init(seed, dtype).items()}
        piece_names = [tuple(n) for n in part.names]
        fns = [_stateless(_spec_piece(model, part.layers[k], k == 0, k == len(part.layers) - 1))
               for k in range(len(part.layers))]
        state_names = [()] * len(fns)
        shared = dict(part.shared)
    else:
        fns, piece_names, init, state_names, state_init = _native_pieces(model, S, v, splits,
                                                                         dtype, backend)
        shared = {}
    shared_stages = {n: tuple(sorted({k % S for k in pieces})) for n, pieces in shared.items()}
    shared_stages = {n: st for n, st in shared_stages.items() if len(st) > 1}
    stage_names, offsets, lengths = _tables(S, len(fns), piece_names, init, shared_stages)
    _, state_offsets, state_lengths = _tables(S, len(fns), state_names, state_init, {})
    n_shared = sum(math.prod(np.shape(init[n])) for n in shared_stages)
    return StagedModel(S, v, fns, piece_names, stage_names, offsets, max(lengths),
                       shared_stages, n_shared, init, state_names, state_offsets,
                       max([1, *state_lengths]), state_init)


def _stateless(fn):
    """A piece ``fn(params, h)`` of a spec model (no state, no randomness) as
    ``fn(params, h, state, rng, train) -> (h, state)``."""
    def run(params, h, state, rng=None, train=True):
        return fn(params, h), state

    return run



def _spec_piece(spec, layers: range, first: bool, last: bool):
    if isinstance(spec, MLP):
        def mlp(p, h):
            import jax.numpy as jnp

            from adapters._jax.models.layers import dense

            for i in layers:
                h = dense(jnp, h, p[f"layers.{i}.kernel"], p[f"layers.{i}.bias"])
                if i < spec.num_layers - 1:
                    h = jnp.maximum(h, 0) if spec.activation == "relu" else jnp.tanh(h)
            return h

        return mlp

    def gpt(p, h):  # FlaxGPT's arithmetic, one piece of it
        import jax.numpy as jnp

        from adapters._jax.models.gpt import _Block, _Dense, _LayerNorm, to_tree

        if first:
            h = jnp.take(p["tok_emb"], h, axis=0) + p["pos_emb"][: h.shape[1]]
        for i in layers:
            prefix = f"blocks.{i}."
            tree = to_tree({n: a for n, a in p.items() if n.startswith(prefix)})[f"blocks_{i}"]
            h = _Block(spec.width, spec.heads).apply({"params": tree}, h)
        if not last:
            return h
        f = _LayerNorm().apply({"params": {"scale": p["ln_f.scale"], "bias": p["ln_f.bias"]}}, h)
        if spec.tied:
            return (f.reshape(-1, spec.width) @ p["tok_emb"].T).reshape(
                *f.shape[:-1], spec.vocab)
        return _Dense(spec.vocab, use_bias=False).apply(
            {"params": {"kernel": p["head.kernel"]}}, f)

    return gpt


@dataclasses.dataclass
class _Layer:
    """One layer of a native sequential model: the prefix of its names, the layer (a Linen
    module, an :class:`~adapters._jax.models.nnx.NnxModule`, or a function such as
    ``nn.relu``), its variables (``{"params": ..., <collection>: ...}``) and the keyword
    arguments it gets for training (``flags(True)``) or evaluation (``flags(False)``)."""

    prefix: str
    layer: Any
    variables: dict
    flags: Any = lambda train: {}


def _mode_flags(layer: Any):
    """``flags(train)``: the keyword a Linen module takes for the mode, as data parallelism
    gives it to a whole model: ``train=train`` when its ``__call__`` takes ``train``; else
    ``deterministic=not train`` (Dropout) or ``use_running_average=not train`` (BatchNorm)
    when it takes one and its attribute of that name is unset (Flax refuses both)."""
    import flax.linen as nn

    if not isinstance(layer, nn.Module):
        return lambda train: {}
    arguments = inspect.signature(type(layer).__call__).parameters
    if "train" in arguments:
        return lambda train: {"train": train}
    for name in ("deterministic", "use_running_average"):
        if name in arguments and getattr(layer, name, None) is None:
            return lambda train, name=name: {name: not train}
    return lambda train: {}


def _native_layers(model, backend) -> tuple[Any, list[_Layer]]:
    """``(sequential, layers)`` of a native sequential model, in order: a list of Flax
    ``(module, variables)`` pairs (prefixes ``0``, ``1``, ..., each module run as data
    parallelism runs a whole model), a ``(flax.linen.Sequential, variables)`` pair, whose layers
    are its ``layers`` (modules or plain functions such as ``nn.relu``) under the names data
    parallelism gives them (``layers_0``, ...), or a Flax NNX ``nnx.Sequential`` (``layers.0``,
    ...; each layer an NNX module behind Linen's ``apply``: ``models/nnx.py``).
    ``sequential`` is the Linen Sequential (its pieces run inside its own scope, so a
    layer draws the dropout mask it draws under data parallelism), else None.

    A Linen Sequential's layers get the mode (:func:`_mode_flags`) only when its own
    ``__call__`` takes ``train``, as data parallelism then gives it to the model (a
    ``nn.Sequential`` subclass handing ``train`` to its layers); a plain ``nn.Sequential``
    passes its arguments to its first layer only, so its layers run as they were built."""
    import flax.linen as nn

    from adapters._jax.models.nnx import NnxModule, is_nnx

    if is_nnx(model):
        from flax import nnx

        if not isinstance(model, nnx.Sequential):
            raise ToolkitError(f"{backend} cannot cut the NNX module {type(model).__name__} "
                               "into pipeline stages: a pipeline needs a sequential model",
                               "build it as an nnx.Sequential of its layers")
        layers, streams = [], 0
        for i, layer in enumerate(model.layers):
            if is_nnx(layer):  # (its random streams numbered as in the whole model's)
                layer = NnxModule(layer, first_stream=streams)
                streams += layer.stream_count
            layers.append(_Layer(f"layers.{i}", layer, layer.variables()
                                 if isinstance(layer, NnxModule) else {},
                                 lambda train: {"train": train}))
        return None, layers
    if (isinstance(model, tuple) and len(model) == 2 and isinstance(model[0], nn.Sequential)):
        seq, variables = model  # (each layer's part of every collection: params, batch_stats)
        takes_train = "train" in inspect.signature(type(seq).__call__).parameters
        return seq, [_Layer(f"layers_{i}", layer,
                            {c: {f"layers_{i}": tree[f"layers_{i}"]}
                             for c, tree in dict(variables or {}).items()
                             if f"layers_{i}" in tree},
                            _mode_flags(layer) if takes_train else lambda train: {})
                     for i, layer in enumerate(seq.layers)]
    pairs = list(model) if isinstance(model, list | tuple) else None
    if (not pairs or isinstance(model, tuple) and len(model) == 2
            and isinstance(model[0], nn.Module)
            or not all(isinstance(p, tuple | list) and len(p) == 2
                       and isinstance(p[0], nn.Module) for p in pairs)):
        raise ToolkitError(f"{backend} cannot cut {type(model).__name__} into pipeline stages: "
                           "a pipeline needs a sequential model", _NATIVE_HINT)
    return None, [_Layer(str(i), module, dict(variables or {}), _mode_flags(module))
                  for i, (module, variables) in enumerate(pairs)]


def _native_pieces(model, S, v, splits, dtype, backend):
    """A native sequential model (:func:`_native_layers`) cut into pieces: layer ``i``'s
    parameters are named ``{prefix}.{path}`` (``0.kernel`` as a torch ``nn.Sequential`` names
    them, or a Flax Sequential's own ``layers_0.kernel``), its model state
    ``{collection}/{prefix}.{path}`` (``batch_stats/layers_1.mean``), as data parallelism
    names both. Returns ``(fns, piece_names, init, state_names, state_init)``."""
    from flax import traverse_util

    seq, layers = _native_layers(model, backend)
    named, state, costs, own, kept = {}, {}, [], [], []
    for i, entry in enumerate(layers):
        # name -> the path in the variables handed to the layer (an NNX list's keys are
        # numbers; a Linen Sequential's layer under its own name: ("layers_0", "kernel"))
        paths, state_paths = {}, {}
        for collection, tree in entry.variables.items():
            for k, value in traverse_util.flatten_dict(dict(tree)).items():
                inner = k[1:] if seq is not None else k
                name = f"{entry.prefix}." + ".".join(map(str, inner))
                value = np.asarray(value)
                if collection == "params":
                    paths[name] = k
                    named[name] = value.astype(dtype)
                    continue
                if not np.issubdtype(value.dtype, np.floating):
                    raise ToolkitError(
                        f"{backend}: layer {i} ({type(entry.layer).__name__}) holds the "
                        f"{value.dtype} model state {collection}/{name}; pipeline stages carry "
                        "floating state (BatchNorm statistics) only",
                        "keep integer counters out of a pipelined model, or use data "
                        "parallelism")
                state_paths[f"{collection}/{name}"] = (collection, k)
                state[f"{collection}/{name}"] = value.astype(dtype)
        own.append(paths)
        kept.append(state_paths)
        costs.append(sum(np.size(named[n]) for n in paths))
    ranges = partition_layers(costs, S, v, splits)
    piece = functools.partial(_seq_piece, seq) if seq is not None else _layer_piece
    fns = [piece(layers, own, kept, r) for r in ranges]
    names = [tuple(n for i in r for n in own[i]) for r in ranges]
    state_names = [tuple(n for i in r for n in kept[i]) for r in ranges]
    return fns, names, named, state_names, state


def _trees(flat: dict[str, Any], paths: dict[str, tuple], state: dict[str, Any],
           state_paths: dict[str, tuple]) -> dict[str, Any]:
    """``{"params": tree, <collection>: tree, ...}`` from values by name."""
    from flax import traverse_util

    out = {"params": traverse_util.unflatten_dict({k: flat[n] for n, k in paths.items()})}
    by_collection: dict[str, dict] = {}
    for n, (collection, k) in state_paths.items():
        by_collection.setdefault(collection, {})[k] = state[n]
    out.update({c: traverse_util.unflatten_dict(t) for c, t in by_collection.items()})
    return out


def _updated(mutated: dict[str, Any], state_paths: dict[str, tuple]) -> dict[str, Any]:
    """Values by name from a training forward's mutated collections."""
    from flax import traverse_util

    flat = {c: traverse_util.flatten_dict(dict(t)) for c, t in dict(mutated).items()}
    return {n: flat[c][k] for n, (c, k) in state_paths.items()}


def _seq_piece(seq, layers: list[_Layer], own, kept, r: range):
    """Layers ``r`` of a Linen Sequential, run inside the Sequential's own scope
    (``apply(method=...)``): each layer sees the names and the ``dropout`` stream it has
    under data parallelism, whatever piece it is in."""
    import flax.linen as nn

    paths = {n: k for i in r for n, k in own[i].items()}
    state_paths = {n: ck for i in r for n, ck in kept[i].items()}
    collections = sorted({c for c, _ in state_paths.values()})

    def run(module, h, train):
        for i in r:
            layer = module.layers[i]
            h = layer(h, **layers[i].flags(train)) if isinstance(layer, nn.Module) else layer(h)
        return h

    def fn(p, h, state, rng=None, train=True):
        variables = _trees(p, paths, state, state_paths)
        rngs = {"dropout": rng} if train and rng is not None else None
        if train and collections:
            out, mutated = seq.apply(variables, h, train, method=run, rngs=rngs,
                                     mutable=collections)
            return out, _updated(mutated, state_paths)
        return seq.apply(variables, h, train, method=run, rngs=rngs), state

    return fn


def _layer_piece(layers: list[_Layer], own, kept, r: range):
    """Layers ``r`` of a list of Flax modules or an NNX Sequential, each applied by itself
    (the ``i``-th module of a list with the dropout key ``fold_in(rng, i)``; an NNX layer with
    the key itself, its streams numbered as in the whole model)."""
    import flax.linen as nn

    from adapters._jax.models.nnx import NnxModule

    def fn(p, h, state, rng=None, train=True):
        import jax

        new = dict(state)
        for i in r:
            layer = layers[i].layer
            if not isinstance(layer, nn.Module | NnxModule):  # (a function: nn.relu)
                h = layer(h)
                continue
            variables = _trees(p, own[i], state, kept[i])
            kwargs = dict(layers[i].flags(train))
            if train and rng is not None:
                kwargs["rngs"] = {"dropout": rng if isinstance(layer, NnxModule)
                                  else jax.random.fold_in(rng, i)}
            if train and kept[i]:
                h, mutated = layer.apply(variables, h, mutable=sorted(
                    {c for c, _ in kept[i].values()}), **kwargs)
                new.update(_updated(mutated, kept[i]))
            else:
                h = layer.apply(variables, h, **kwargs)
        return h, new

    return fn


def computing(fn, compute: Any = None):
    """A piece's ``fn(params, h, *rest)`` run in the ``compute`` dtype of a mixed-precision
    policy (its parameters and a floating input cast to it, as data parallelism's forward casts
    them; the model state as it is); None: ``fn`` itself."""
    if compute is None:
        return fn

    def run(params, h, *rest, **kwargs):
        import jax

        from adapters._jax.models.spec import in_compute

        return fn(in_compute(jax, params, compute), in_compute(jax, h, compute), *rest,
                  **kwargs)

    return run


def eval_sums(staged: StagedModel, loss_fn: Any, loss: str, metrics: dict[str, Any],
              compute: Any = None):
    """``sums(params_by_name, state_by_name, x, y)``: the evaluation sums of the whole model,
    piece after piece on one device, in evaluation mode (running averages, no dropout)
    (``loss_sum``, ``correct`` for classification, one per metric), in the arithmetic it trains
    in (``compute``: :func:`computing`), the loss in the parameters' dtype."""
    from adapters._jax.models.spec import correct_per_sample, per_sample_loss

    def sums(params, state, x, y):
        import jax.numpy as jnp

        h, dtype = x, next(iter(params.values())).dtype
        for k in range(staged.pieces):
            h, _ = computing(staged.fns[k], compute)(
                {n: params[n] for n in staged.piece_names[k]}, h,
                {n: state[n] for n in staged.state_names[k]}, None, train=False)
        h = h.astype(dtype)
        out = {"loss_sum": jnp.sum(per_sample_loss(jnp, loss_fn, h, y))}
        if loss == "cross_entropy":
            out["correct"] = correct_per_sample(jnp, h, y)
        for name, fn in metrics.items():
            out[name] = jnp.sum(fn(h, y))
        return out

    return sums
