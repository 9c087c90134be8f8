"""horovod-torch's sharded layout, framework-light parts: the sharding units of a native
module or a spec model, ``toolkit.models.reference.apply_update`` in place on one flat shard,
and the axis permutation between a parameter's neutral and torch layouts."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from toolkit import SGD, ToolkitError
from toolkit.parallel.shards import unit_layouts

SHARDABLE = ("horovod-torch shards toolkit.MLP/CNN/GPT specs, and native nn.Modules whose "
             "trainable parameters are reached as module attributes (Linear, Conv, LayerNorm, "
             "Embedding, ...); units are the module's top-level children")


def native_units(torch, net) -> dict[str, list[str]]:
    """Units of a native module (its top-level children; a parameter of the root module is a
    unit of its own), or a ToolkitError for a module this cannot shard soundly."""
    recurrent = [n or type(m).__name__ for n, m in net.named_modules()
                 if isinstance(m, torch.nn.RNNBase)]
    if recurrent:
        raise ToolkitError(f"cannot shard the recurrent module {recurrent[0]!r}: it keeps its "
                           "own cached flat weights", SHARDABLE)
    frozen = [n for n, p in net.named_parameters() if not p.requires_grad]
    if frozen:
        raise ToolkitError(f"cannot shard a module with frozen parameters ({frozen[0]!r}): the "
                           "sharded optimizer updates every parameter", SHARDABLE)
    units: dict[str, list[str]] = {}
    for name, _ in net.named_parameters():
        units.setdefault(name.split(".")[0], []).append(name)
    if not units:
        raise ToolkitError(f"the module {type(net).__name__} has no parameters to shard",
                           SHARDABLE)
    return units


def spec_units(arrays: dict[str, np.ndarray]) -> dict[str, list[str]]:
    """The units of a spec model (``toolkit.parallel.shards.units_of``: blocks, layers or convs)."""
    return {unit: list(fl.names)
            for unit, fl in unit_layouts({n: a.shape for n, a in arrays.items()}, 1).items()}


def update_shard(spec, p, g, slots, lr: float, step_size: Any, c2_sqrt: Any) -> None:
    """``toolkit.models.reference.apply_update`` in place on one flat shard. Adam's
    ``step_size`` and ``c2_sqrt`` may be host numbers or 0-d tensors on the device (a deferred
    step's, picked by its own skip count): the same arithmetic either way."""
    if isinstance(spec, SGD):
        if spec.weight_decay:
            g = g.add(p, alpha=spec.weight_decay)
        if spec.momentum:
            buf = slots["momentum"]
            buf.mul_(spec.momentum).add_(g)
            g = g.add(buf, alpha=spec.momentum) if spec.nesterov else buf
        p.add_(g, alpha=-lr)
        return
    if spec.decoupled:
        p.mul_(1 - lr * spec.weight_decay)
    elif spec.weight_decay:
        g = g.add(p, alpha=spec.weight_decay)
    m, v = slots["mu"], slots["nu"]
    m.mul_(spec.b1).add_(g, alpha=1 - spec.b1)
    v.mul_(spec.b2).addcmul_(g, g, value=1 - spec.b2)
    # (m * -step_size, then / denominator: addcdiv's own order with value=-step_size, which
    # takes only a host number)
    p.addcdiv_(m * -step_size, v.sqrt().div_(c2_sqrt).add_(spec.eps))


def permutation(to_torch, shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The axis permutation that ``to_torch`` applies to a neutral array of ``shape`` (None for
    the identity), found by applying it to an array of element indices."""
    index = np.arange(int(np.prod(shape))).reshape(shape)
    moved = np.asarray(to_torch(index))
    for perm in itertools.permutations(range(len(shape))):
        if moved.shape == index.transpose(perm).shape and np.array_equal(
                moved, index.transpose(perm)):
            return None if perm == tuple(range(len(shape))) else perm
    raise ToolkitError(f"a parameter of shape {shape} is not an axis permutation of its "
                       "neutral layout", SHARDABLE)
