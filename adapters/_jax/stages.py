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

The schedule's rounds are in ``rounds.py``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from toolkit import ToolkitError
from toolkit.models.specs import CNN, MLP, ModelSpec
from toolkit.parallel.pipeline.partition import partition_layers, partition_model

_NATIVE_HINT = ("pass a toolkit.MLP/GPT spec, a (flax.linen.Sequential, variables) pair, an "
                "nnx.Sequential, or a list of (flax module, variables) pairs applied in order "
                "(each variables = module.init(key, x))")


@dataclasses.dataclass
class StagedModel:
    """A model cut into pieces, and each stage's flat parameter layout.

    Attributes:
        stages, chunks: ``S`` and ``v``.
        fns: per piece, ``fn(params_by_name, h) -> h`` (the last piece returns the outputs).
        piece_names: per piece, the parameter names it uses.
        stage_names: per stage, the names in its flat vector, in order (shared names first).
        offsets: per stage, name -> (offset, shape) in its flat vector.
        length: the flat vectors' common (padded) length.
        shared: name -> stages holding it (more than one).
        n_shared: elements at the front of each holder's vector that belong to shared names.
        init: name -> initial array (numpy).
    """

    stages: int
    chunks: int
    fns: list
    piece_names: list[tuple[str, ...]]
    stage_names: list[tuple[str, ...]]
    offsets: list[dict[str, tuple[int, tuple[int, ...]]]]
    length: int
    shared: dict[str, tuple[int, ...]]
    n_shared: int
    init: dict[str, np.ndarray]

    @property
    def pieces(self) -> int:
        return len(self.fns)

    def stage_of(self, piece: int) -> int:
        return piece % self.stages

    def holders_mask(self) -> np.ndarray:
        """1.0 for the stages that hold the shared names, else 0.0."""
        holders = {s for stages in self.shared.values() for s in stages}
        return np.asarray([1.0 if s in holders else 0.0 for s in range(self.stages)])

    def flatten(self, named: dict[str, np.ndarray], dtype: str) -> np.ndarray:
        """Full tensors by name -> the ``(S, length)`` stack of stage vectors."""
        out = np.zeros((self.stages, self.length), dtype)
        for s in range(self.stages):
            for name, (off, shape) in self.offsets[s].items():
                out[s, off:off + math.prod(shape)] = np.asarray(named[name]).reshape(-1)
        return out

    def unflatten(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """The ``(S, length)`` stack -> full tensors by name (a shared one from its first
        holder)."""
        named: dict[str, np.ndarray] = {}
        for s in range(self.stages):
            for name, (off, shape) in self.offsets[s].items():
                if name not in named:
                    named[name] = np.array(flat[s, off:off + math.prod(shape)]).reshape(shape)
        return named

    def owner_stage(self, name: str) -> int:
        """The one stage whose copy of ``name`` a checkpoint stores."""
        return next(s for s in range(self.stages) if name in self.offsets[s])

    def names(self) -> list[str]:
        """Every parameter name once, in the model's order."""
        seen: dict[str, None] = {}
        for names in self.piece_names:
            seen.update(dict.fromkeys(names))
        return list(seen)

    def piece_params(self, flat, piece: int) -> dict[str, Any]:
        """Piece ``piece``'s parameters sliced (statically) out of its stage's flat vector, or
        picked from a dict of the stage's parameters by name (:meth:`stage_params`)."""
        if isinstance(flat, dict):
            return {n: flat[n] for n in self.piece_names[piece]}
        offsets = self.offsets[self.stage_of(piece)]
        return {n: flat[offsets[n][0]:offsets[n][0] + math.prod(offsets[n][1])].reshape(
            offsets[n][1]) for n in self.piece_names[piece]}

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


def stage_model(model: Any, layout: Any, seed: int, dtype: str, backend: str) -> StagedModel:
    """``model`` (a toolkit.MLP/GPT spec or a list of (flax module, variables) pairs) cut as
    ``layout`` (a ``toolkit.Pipeline``) says."""
    S, v = layout.stages, layout.chunks
    splits = layout.splits or None
    if isinstance(model, ModelSpec):
        if isinstance(model, CNN):
            raise ToolkitError(f"{backend} cannot cut the CNN spec into pipeline stages",
                               "use toolkit.MLP or toolkit.GPT with a pipeline layout")
        part = partition_model(model, S, v, splits)
        init = {n: np.asarray(a).astype(dtype) if np.issubdtype(np.asarray(a).dtype, np.floating)
                else np.asarray(a) for n, a in model.init(seed, dtype).items()}
        piece_names = [tuple(n) for n in part.names]
        fns = [_spec_piece(model, part.layers[k], k == 0, k == len(part.layers) - 1)
               for k in range(len(part.layers))]
        shared = dict(part.shared)
    else:
        fns, piece_names, init = _native_pieces(model, S, v, splits, dtype, backend)
        shared = {}
    shared_stages = {n: tuple(sorted({k % S for k in pieces})) for n, pieces in shared.items()}
    shared_stages = {n: st for n, st in shared_stages.items() if len(st) > 1}
    stage_names, offsets, lengths = [], [], []
    for s in range(S):
        names: dict[str, None] = {}
        for k in range(s, len(fns), S):
            names.update(dict.fromkeys(piece_names[k]))
        first = [n for n in shared_stages if n in names]
        ordered = tuple(first + [n for n in names if n not in first])
        table, off = {}, 0
        for n in ordered:
            shape = tuple(np.shape(init[n]))
            table[n] = (off, shape)
            off += math.prod(shape)
        stage_names.append(ordered)
        offsets.append(table)
        lengths.append(off)
    n_shared = sum(math.prod(np.shape(init[n])) for n in shared_stages)
    return StagedModel(S, v, fns, piece_names, stage_names, offsets, max(lengths),
                       shared_stages, n_shared, init)


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


def _native_layers(model, backend) -> list[tuple[str, Any, dict]]:
    """``(prefix, layer, variables)`` of each layer of a native sequential model, in order: a
    list of Flax ``(module, variables)`` pairs (prefixes ``0``, ``1``, ...), a
    ``(flax.linen.Sequential, variables)`` pair, whose layers are its ``layers`` (modules or
    plain functions such as ``nn.relu``) under the names data parallelism gives them
    (``layers_0``, ...), or a Flax NNX ``nnx.Sequential`` (``layers.0``, ...; each layer an
    NNX module behind Linen's ``apply``: ``models/nnx.py``)."""
    import flax.linen as nn

    from adapters._jax.models.nnx import NnxModule, is_nnx

    if is_nnx(model):
        from flax import nnx

        if not isinstance(model, nnx.Sequential):
            raise ToolkitError(f"{backend} cannot cut the NNX module {type(model).__name__} "
                               "into pipeline stages: a pipeline needs a sequential model",
                               "build it as an nnx.Sequential of its layers")
        wrapped = [NnxModule(layer) if is_nnx(layer) else layer for layer in model.layers]
        return [(f"layers.{i}", layer, layer.variables() if isinstance(layer, NnxModule) else {})
                for i, layer in enumerate(wrapped)]
    if (isinstance(model, tuple) and len(model) == 2 and isinstance(model[0], nn.Sequential)):
        seq, variables = model  # (each layer's part of every collection: params, batch_stats)
        return [(f"layers_{i}", layer, {c: tree[f"layers_{i}"] for c, tree in
                                        dict(variables or {}).items() if f"layers_{i}" in tree})
                for i, layer in enumerate(seq.layers)]
    pairs = list(model) if isinstance(model, list | tuple) else None
    if (not pairs or isinstance(model, tuple) and len(model) == 2
            and isinstance(model[0], nn.Module)
            or not all(isinstance(p, tuple | list) and len(p) == 2
                       and isinstance(p[0], nn.Module) for p in pairs)):
        raise ToolkitError(f"{backend} cannot cut {type(model).__name__} into pipeline stages: "
                           "a pipeline needs a sequential model", _NATIVE_HINT)
    return [(str(i), module, dict(variables or {})) for i, (module, variables) in
            enumerate(pairs)]


def _native_pieces(model, S, v, splits, dtype, backend):
    """A native sequential model (:func:`_native_layers`) cut into pieces: layer ``i``'s
    parameters are named ``{prefix}.{path}`` (``0.kernel`` as a torch ``nn.Sequential`` names
    them, or a Flax Sequential's own ``layers_0.kernel``)."""
    import flax.linen as nn
    from flax import traverse_util

    from adapters._jax.models.nnx import NnxModule

    layers, named, costs, own = _native_layers(model, backend), {}, [], []
    for i, (prefix, layer, variables) in enumerate(layers):
        extra = [c for c in variables if c != "params"]
        if extra:
            raise ToolkitError(f"{backend}: layer {i} ({type(layer).__name__}) has model state "
                               f"{extra}; pipeline stages carry parameters only",
                               "use layers without BatchNorm statistics in a pipeline")
        flat = traverse_util.flatten_dict(dict(variables.get("params", {})))
        # name -> the layer's own path (an NNX list's keys are numbers)
        paths = {f"{prefix}." + ".".join(map(str, k)): k for k in flat}
        named.update({n: np.asarray(flat[k]).astype(dtype) for n, k in paths.items()})
        own.append(paths)
        costs.append(sum(np.size(a) for a in flat.values()))
    ranges = partition_layers(costs, S, v, splits)

    def piece(r: range):
        def fn(p, h):
            for i in r:
                _, layer, _ = layers[i]
                if not isinstance(layer, nn.Module | NnxModule):  # (a function: nn.relu)
                    h = layer(h)
                    continue
                tree = traverse_util.unflatten_dict({k: p[n] for n, k in own[i].items()})
                h = layer.apply({"params": tree}, h)
            return h

        return fn

    names = [tuple(n for i in r for n in own[i]) for r in ranges]
    return [piece(r) for r in ranges], names, named


def computing(fn, compute: Any = None):
    """A piece's ``fn(params, h)`` run in the ``compute`` dtype of a mixed-precision policy (its
    parameters and a floating input cast to it, as data parallelism's forward casts them);
    None: ``fn`` itself."""
    if compute is None:
        return fn

    def run(params, h):
        import jax

        from adapters._jax.models.spec import in_compute

        return fn(in_compute(jax, params, compute), in_compute(jax, h, compute))

    return run


def eval_sums(staged: StagedModel, loss_fn: Any, loss: str, metrics: dict[str, Any],
              compute: Any = None):
    """``sums(params_by_name, x, y)``: the evaluation sums of the whole model, piece after
    piece on one device (``loss_sum``, ``correct`` for classification, one per metric), in the
    arithmetic it trains in (``compute``: :func:`computing`), the loss in the parameters'
    dtype."""
    from adapters._jax.models.spec import correct_per_sample, per_sample_loss

    def sums(params, x, y):
        import jax.numpy as jnp

        h, dtype = x, next(iter(params.values())).dtype
        for k in range(staged.pieces):
            h = computing(staged.fns[k], compute)(
                {n: params[n] for n in staged.piece_names[k]}, h)
        h = h.astype(dtype)
        out = {"loss_sum": jnp.sum(per_sample_loss(jnp, loss_fn, h, y))}
        if loss == "cross_entropy":
            out["correct"] = correct_per_sample(jnp, h, y)
        for name, fn in metrics.items():
            out[name] = jnp.sum(fn(h, y))
        return out

    return sums
