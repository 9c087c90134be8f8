"""Named axes over the world's devices: which device holds which stage, shard, replica and
tensor part, as plain arithmetic (the dimensions of a composed layout,
``toolkit.ParallelDims``).

The devices are numbered as the launch numbers them: rank by rank, and each rank's local
devices in order (JAX's process-major order). A :class:`Grid` lays its axes over these numbers
with the innermost axis on consecutive numbers, so on one node when it fits, and the outermost
across nodes: with Slurm's and Open MPI's block placement (a node's ranks consecutive), the
placement ``tensor, data, pipeline, replicate`` keeps a tensor-parallel group's all-reduces
inside a node and puts only the replicas' reduction on the link between nodes, as Megatron-LM
and MaxText place them.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Grid:
    """Devices ``0 .. size - 1`` on named axes.

    Args:
        axes: ``(name, size)`` pairs, the outermost first (the last varies fastest).

    Example (pipeline 2 x data 2 x tensor 2, tensor innermost):
        >>> g = Grid((("pipeline", 2), ("data", 2), ("tensor", 2)))
        >>> g.coords(5)
        {'pipeline': 1, 'data': 0, 'tensor': 1}
        >>> g.group(5, "data"), g.group(5, "tensor")
        ((5, 7), (4, 5))
    """

    axes: tuple[tuple[str, int], ...]

    @property
    def size(self) -> int:
        return math.prod(n for _, n in self.axes)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.axes)

    def extent(self, axis: str) -> int:
        """The size of ``axis``."""
        return dict(self.axes)[axis]

    def coords(self, index: int) -> dict[str, int]:
        """Device ``index``'s coordinate on each axis."""
        out = {}
        for name, n in reversed(self.axes):
            index, out[name] = divmod(index, n)
        return dict(reversed(out.items()))

    def index(self, coords: dict[str, int]) -> int:
        """The device at ``coords`` (every axis named)."""
        i = 0
        for name, n in self.axes:
            i = i * n + coords[name]
        return i

    def group(self, index: int, axis: str) -> tuple[int, ...]:
        """The devices that differ from ``index`` only along ``axis`` (the group a collective
        over that axis runs in), in increasing order."""
        c = self.coords(index)
        return tuple(self.index({**c, axis: k}) for k in range(self.extent(axis)))

    def groups(self, axis: str) -> tuple[tuple[int, ...], ...]:
        """Every group of ``axis``, in the order of their first devices."""
        seen: dict[tuple[int, ...], None] = {}
        for i in range(self.size):
            seen.setdefault(self.group(i, axis))
        return tuple(seen)
