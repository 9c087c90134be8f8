"""Flat per-unit buffers for the JAX backends' sharded layouts (ZeRO stages 1-3 / FSDP).

A model's parameters are grouped into units (``toolkit.parallel.shards.units_of`` for the spec
models: ``layers.i``, ``convs.i``, ``blocks.i``; a native Flax module's top-level submodules),
and each unit is one flat buffer padded to a multiple of the shard count
(``toolkit.parallel.shards.FlatLayout``). The optimizer (``adapters._jax.update.make_optimizer``,
or a native optax transformation that ``adapters._jax.native_optax`` found elementwise) runs on
flat shards unchanged; padding has a zero gradient, and no parameter reads it.

Both backends keep their state as ``{unit: flat array}`` dicts: jax-pjit as global arrays
sharded over the mesh's ``data`` axis, jax-pmap as per-device shards stacked on a leading axis.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from adapters._jax.models.layers import dense
from toolkit import CNN, MLP, ToolkitError
from toolkit.parallel.layouts import AXES
from toolkit.parallel.shards import FlatLayout, unit_layouts


class FlatUnits:
    """The flat layouts of a model's units over ``shards`` shards, and the (un)flattening.

    Args:
        model: an ``adapters._jax.models.spec.JaxModel``.
        shards: the number of shards each unit's buffer is cut into.
        exclude: neutral names kept out of the flat buffers (tensor-parallel kernels).
    """

    def __init__(self, model: Any, shards: int, exclude: tuple[str, ...] = ()):
        shapes = {n: tuple(np.shape(v)) for n, v in model.flat(model.params).items()
                  if n not in exclude}
        if not model.native:
            self.layouts = unit_layouts(shapes, shards)
        else:  # a native module: one unit per top-level submodule (or top-level leaf)
            groups: dict[str, dict[str, tuple[int, ...]]] = {}
            for name, shape in shapes.items():
                groups.setdefault(name.split(".")[0], {})[name] = shape
            self.layouts = {unit: FlatLayout.from_shapes(group, shards)
                            for unit, group in groups.items()}
        self.shards = shards

    def flatten(self, named: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Host arrays by neutral name -> each unit's padded flat buffer."""
        return {u: layout.flatten(named) for u, layout in self.layouts.items()}

    def named(self, flats: dict[str, Any]) -> dict[str, Any]:
        """Each unit's full flat buffer (numpy or traced jnp) -> arrays by neutral name.

        Inside a jitted function over sharded buffers, the slices make the compiler gather.
        """
        out = {}
        for unit, layout in self.layouts.items():
            out.update(unit_named(layout, flats[unit]))
        return out

    def pieces(self, unit: str, lo: int, data: np.ndarray,
               key: Callable[[str], str]) -> dict[str, tuple[np.ndarray, int, tuple[int, ...]]]:
        """This process's checkpoint pieces of one unit, from the elements ``[lo, lo +
        len(data))`` of its flat buffer that it holds (its devices' consecutive shards), each
        under ``key(neutral name)``."""
        layout = self.layouts[unit]
        out = {}
        for name, shape, start, size in zip(layout.names, layout.shapes, layout.offsets,
                                            layout.sizes, strict=True):
            a, b = max(lo, start), min(lo + len(data), start + size)
            piece = data[a - lo:b - lo] if a < b else data[:0]
            out[key(name)] = (np.ascontiguousarray(piece), 0, shape)
        return out


def unit_named(layout: FlatLayout, flat: Any) -> dict[str, Any]:
    """One unit's flat buffer (at least ``layout.total`` elements) -> its parameters."""
    return {name: flat[start:start + size].reshape(shape)
            for name, shape, start, size in zip(layout.names, layout.shapes, layout.offsets,
                                                layout.sizes, strict=True)}


def check_layout(backend: str, layout: Any, tensor_parallel_ok: bool = False) -> Any:
    """``layout`` when its dimensions shard (or split tensors) without a pipeline, in the
    default placement (a device's shard follows the launch's device order); ``tensor > 1``
    only where the backend splits layers."""
    dims = getattr(layout, "dims", None)
    if dims is None or dims.pipeline is not None or not (dims.zero or dims.tensor > 1):
        raise ToolkitError(f"{backend} cannot shard as {layout!r}",
                           "pass toolkit.Sharded(stage=1|2|3)")
    if dims.tensor > 1 and not tensor_parallel_ok:
        raise ToolkitError(
            f"{backend} cannot run tensor_parallel={dims.tensor}: only jax-pjit "
            "splits layers", "use tensor_parallel=1 or --backend jax-pjit")
    if dims.place != AXES:
        raise ToolkitError(
            f"{backend} places a sharded layout's devices in the default order only, not "
            f"place:{':'.join(dims.place)}",
            f"drop place: (the default: {':'.join(AXES)}, innermost first)")
    return layout


def state_head(adapter: Any, model_state: dict, named_params: Any):
    """The part of ``sharded_state`` both JAX sharded strategies share: ``(replicated,
    stores)``, where ``replicated`` holds the model state (host arrays), Adam's step count (a
    native optax state's leaves other than per-parameter ones) and, below stage 3, the
    parameters (``named_params()``: name -> host array), and ``stores`` lists the ``(key,
    sharded store)`` pairs each process cuts into pieces (``key(neutral name)``: a piece's
    name)."""
    replicated = {**adapter.model.flat_state(model_state), **adapter.rule.counters()}
    if adapter.optax is not None:  # (adapters._jax.native_optax.ShardedOptax)
        scalars, stores = adapter.optax.stores(adapter.opt_state)
        replicated.update(scalars)
    else:
        stores = [(lambda n, s=slot: f"opt/{s}/{n}", store)
                  for slot, store in adapter.opt_state.items()]
    if adapter.layout.dims.zero == 3:
        stores.append((lambda n: f"params/{n}", adapter.params))
    else:
        replicated.update({f"params/{n}": v for n, v in named_params().items()})
    return replicated, stores


def nbytes(tree: Any) -> int:
    """Bytes of every device buffer of this process in ``tree`` (addressable shards)."""
    import jax

    return sum(shard.data.nbytes for leaf in jax.tree_util.tree_leaves(tree)
               for shard in leaf.addressable_shards)


def local_range(array: Any) -> tuple[int, np.ndarray]:
    """``(lo, data)``: the consecutive elements ``[lo, lo + len(data))`` of a 1-D global array
    that this process's devices hold (duplicates of replicated shards dropped)."""
    parts: dict[int, np.ndarray] = {}
    for shard in array.addressable_shards:
        start = shard.index[0].start or 0
        parts.setdefault(start, np.asarray(shard.data))
    starts = sorted(parts)
    at = starts[0]
    for s in starts:
        if s != at:
            raise ToolkitError("this process's shards are not consecutive",
                               "build the mesh with each process's devices together")
        at += len(parts[s])
    return starts[0], np.concatenate([parts[s] for s in starts])


def unit_forward(spec: Any, unit: str, named: dict[str, Any], h: Any) -> Any:
    """One unit's part of a spec model's forward pass (FSDP's wrapped module): the
    activations after unit ``unit`` from those before it (token ids or inputs for the first
    unit), with the unit's parameters ``named`` (neutral names; a tied GPT's last unit gets
    ``tok_emb`` too). The same function as the Flax modules of ``adapters._jax.models.spec``."""
    import jax
    import jax.numpy as jnp

    kind, index = unit.split(".")
    if isinstance(spec, MLP):
        z = dense(jnp, h, named[f"{unit}.kernel"], named[f"{unit}.bias"])
        if int(index) < spec.num_layers - 1:
            z = jax.nn.relu(z) if spec.activation == "relu" else jnp.tanh(z)
        return z
    if isinstance(spec, CNN):
        z = jax.lax.conv_general_dilated(h, named[f"{unit}.kernel"], (1, 1), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
        z = jax.nn.relu(z + named[f"{unit}.bias"])
        if "head.kernel" in named:
            z = dense(jnp, z.reshape((z.shape[0], -1)), named["head.kernel"], named["head.bias"])
        return z
    from flax import traverse_util

    from adapters._jax.models import gpt as flax_gpt  # (it imports Flax)

    if "pos_emb" in named:  # the first unit (a tied head's extra is tok_emb alone)
        h = jnp.take(named["tok_emb"], h, axis=0) + named["pos_emb"][: h.shape[1]]
    prefix = f"{unit}."
    block = traverse_util.unflatten_dict({tuple(n[len(prefix):].split(".")): v
                                          for n, v in named.items() if n.startswith(prefix)})
    h = flax_gpt._Block(spec.width, spec.heads).apply({"params": block}, h)
    if "ln_f.scale" in named:
        f = flax_gpt._LayerNorm().apply(
            {"params": {"scale": named["ln_f.scale"], "bias": named["ln_f.bias"]}}, h)
        head = named["tok_emb"].T if spec.tied else named["head.kernel"]
        h = (f.reshape(-1, spec.width) @ head).reshape(*f.shape[:-1], -1)
    return h
