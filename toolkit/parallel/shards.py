"""How parameters are cut into flat shards (ZeRO / FSDP), in numpy.

The parameters of a unit, in a fixed order, are flattened and concatenated into one 1-D
buffer of ``total`` elements, padded with zeros at the end to ``padded``, the next multiple of
the world size ``N``. Rank ``r`` owns the elements ``[r*L, (r+1)*L)`` with ``L = padded / N``:
every rank holds the same number of elements, and the padding (fewer than ``N`` elements) lies in
the last ranks' shards. A parameter can straddle ranks; ``owned(rank)`` says which slice of
which parameter a rank holds, so a checkpoint can name every piece by its full parameter's name.

A *unit* is a group of parameters gathered together (FSDP's wrapped module): one transformer
block, one dense layer. ``units_of`` groups a model's names; ``unit_layouts`` builds one flat
layout per unit.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping

import numpy as np

from toolkit.errors import ToolkitError


@dataclasses.dataclass(frozen=True)
class FlatLayout:
    """The flat buffer of ``names`` (with ``shapes``) cut into ``world_size`` equal shards."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    world_size: int

    @classmethod
    def from_shapes(cls, shapes: Mapping[str, tuple[int, ...]], world_size: int) -> FlatLayout:
        """The layout of ``shapes`` (name -> shape, in flat order) over ``world_size`` ranks."""
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ToolkitError(f"world size {world_size!r} must be a positive integer",
                               "shard over 1 or more ranks")
        if not shapes:
            raise ToolkitError("no parameters to shard", "pass at least one name -> shape")
        return cls(tuple(shapes), tuple(tuple(int(d) for d in s) for s in shapes.values()),
                   world_size)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(math.prod(s) for s in self.shapes)

    @property
    def offsets(self) -> tuple[int, ...]:
        """Where each parameter starts in the flat buffer."""
        out, at = [], 0
        for size in self.sizes:
            out.append(at)
            at += size
        return tuple(out)

    @property
    def total(self) -> int:
        """Elements of all parameters, without padding."""
        return sum(self.sizes)

    @property
    def padded(self) -> int:
        """``total`` rounded up to a multiple of the world size."""
        return -(-self.total // self.world_size) * self.world_size

    @property
    def shard_size(self) -> int:
        """Elements each rank holds, padding included."""
        return self.padded // self.world_size

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ToolkitError(f"rank {rank} is outside a world of {self.world_size}",
                               f"ranks are 0 to {self.world_size - 1}")

    def owned(self, rank: int) -> list[tuple[str, int, int, int]]:
        """The pieces rank ``rank`` holds, in flat order.

        Each is ``(name, param_start, param_stop, shard_start)``: the elements
        ``[param_start, param_stop)`` of the flattened parameter ``name`` lie at
        ``shard_start`` in the rank's shard. Padding is not listed.
        """
        self._check_rank(rank)
        lo, hi = rank * self.shard_size, (rank + 1) * self.shard_size
        pieces = []
        for name, start, size in zip(self.names, self.offsets, self.sizes, strict=True):
            a, b = max(lo, start), min(hi, start + size)
            if a < b:
                pieces.append((name, a - start, b - start, a - lo))
        return pieces

    def pieces(self, shard: np.ndarray, rank: int | None, prefix: str = "") -> dict[str, tuple]:
        """Checkpoint pieces of rank ``rank``'s ``shard``: ``prefix + name -> (flat piece, 0,
        full shape)`` for every tensor, empty where the shard holds none of it (every one
        for ``rank`` None: a copy no one writes). The ranks' pieces concatenated in rank order
        are each tensor, flattened (``CheckpointStore.save``'s ``shards``)."""
        out = {prefix + n: (np.zeros((0,), shard.dtype), 0, shape)
               for n, shape in zip(self.names, self.shapes, strict=True)}
        for n, a, b, at in self.owned(rank) if rank is not None else ():
            out[prefix + n] = (np.array(shard[at:at + b - a]), 0,
                               self.shapes[self.names.index(n)])
        return out

    def _check_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        missing = [n for n in self.names if n not in arrays]
        if missing:
            raise ToolkitError(f"arrays lack parameters {missing[:3]}",
                               "pass every parameter the layout was built from")
        for name, shape in zip(self.names, self.shapes, strict=True):
            if tuple(np.shape(arrays[name])) != shape:
                raise ToolkitError(f"parameter {name} has shape {np.shape(arrays[name])}, "
                                   f"the layout expects {shape}", "build the layout from the "
                                   "same shapes as the arrays")

    def flatten(self, arrays: Mapping[str, np.ndarray]) -> np.ndarray:
        """The 1-D padded buffer (zeros in the padding), in the arrays' common dtype."""
        self._check_arrays(arrays)
        dtype = np.result_type(*(np.asarray(arrays[n]).dtype for n in self.names))
        flat = np.zeros(self.padded, dtype)
        for name, start, size in zip(self.names, self.offsets, self.sizes, strict=True):
            flat[start:start + size] = np.asarray(arrays[name]).reshape(-1)
        return flat

    def unflatten(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """The parameters of a full (padded or unpadded) flat buffer, as copies."""
        flat = np.asarray(flat).reshape(-1)
        if len(flat) not in (self.total, self.padded):
            raise ToolkitError(f"flat buffer has {len(flat)} elements, expected {self.padded}",
                               "pass the output of flatten() or the concatenated shards")
        return {name: flat[start:start + size].reshape(shape).copy()
                for name, shape, start, size in zip(self.names, self.shapes, self.offsets,
                                                    self.sizes, strict=True)}

    def shard(self, arrays: Mapping[str, np.ndarray], rank: int) -> np.ndarray:
        """Rank ``rank``'s ``shard_size`` elements of the flat buffer (zeros in the padding)."""
        self._check_rank(rank)
        self._check_arrays(arrays)
        dtype = np.result_type(*(np.asarray(arrays[n]).dtype for n in self.names))
        out = np.zeros(self.shard_size, dtype)
        for name, a, b, at in self.owned(rank):
            out[at:at + b - a] = np.asarray(arrays[name]).reshape(-1)[a:b]
        return out

    def gather(self, shards: Iterable[np.ndarray]) -> dict[str, np.ndarray]:
        """The parameters from every rank's shard, in rank order (all-gather's inverse)."""
        shards = [np.asarray(s).reshape(-1) for s in shards]
        if len(shards) != self.world_size or any(len(s) != self.shard_size for s in shards):
            raise ToolkitError(
                f"gather needs {self.world_size} shards of {self.shard_size} elements, got "
                f"{[len(s) for s in shards]}", "pass every rank's shard, in rank order")
        return self.unflatten(np.concatenate(shards))


_BLOCK = re.compile(r"^(blocks|layers|convs)\.(\d+)\.")


def units_of(names: Iterable[str]) -> dict[str, list[str]]:
    """Groups parameter names into units gathered together, in the model's order.

    ``blocks.{i}.*`` (GPT), ``layers.{i}.*`` (MLP) and ``convs.{i}.*`` (CNN) form unit
    ``blocks.{i}`` (``layers.{i}``, ``convs.{i}``). Names before the first numbered unit
    (a GPT's embeddings) join the first unit, names after the last (``ln_f``, ``head``) join the
    last. A model without numbered units is one unit, ``all``.

    Example:
        >>> units_of(["tok_emb", "blocks.0.ln1.scale", "blocks.1.ln1.scale", "ln_f.scale"])
        ... # doctest: +NORMALIZE_WHITESPACE
        {'blocks.0': ['tok_emb', 'blocks.0.ln1.scale'],
         'blocks.1': ['blocks.1.ln1.scale', 'ln_f.scale']}
    """
    names = list(names)
    units: dict[str, list[str]] = {}
    before: list[str] = []
    last = None
    for name in names:
        match = _BLOCK.match(name)
        if match:
            last = f"{match.group(1)}.{match.group(2)}"
            if last not in units:
                units[last] = before
                before = []
            units[last].append(name)
        elif last is None:
            before.append(name)
        else:
            units[last].append(name)
    if not units:
        return {"all": before}
    return units


def unit_layouts(shapes: Mapping[str, tuple[int, ...]],
                 world_size: int) -> dict[str, FlatLayout]:
    """One flat layout per unit of ``units_of(shapes)``, each over ``world_size`` ranks."""
    return {unit: FlatLayout.from_shapes({n: shapes[n] for n in names}, world_size)
            for unit, names in units_of(shapes).items()}
