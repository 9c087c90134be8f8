"""ZeRO-3's all-gathers in the compute dtype (FSDP2's ``MixedPrecisionPolicy.param_dtype``)
for ``horovod-torch`` under bf16-mixed and fp16-mixed, with the arithmetic unchanged.

A spec model's forward under ``torch.autocast`` rounds the kernels and biases of its dense and
convolution layers to the compute dtype (``addmm``, ``conv``) and uses its embeddings and layer
norms' parameters in float32 (a lookup, and the contract's float32 statistics). So a unit's
shard is sent in the compute dtype (half the bytes in bfloat16) and the module gets its dense
and convolution parameters as 16-bit views of what arrived: autocast then casts nothing, and
what an operation saves for the backward is a view of the gathered buffer, which stage 3's
saved-tensor hooks free after the unit's forward and gather again for its backward, as in
float32 (autocast's own 16-bit copies would stay until the backward). The parameters used in
float32 come in a second, float32 all-gather of just their elements, as views of that. Every
parameter holds the value the arithmetic reads, bit for bit what gathering in float32 and
casting gave. The gradient's reduce-scatter stays float32 (FSDP2's ``reduce_dtype``). A module
of your own is gathered in float32: which of its parameters autocast rounds is its forward's
business, not the toolkit's to guess.
"""

from __future__ import annotations

import numpy as np


def rounded_names(names) -> set[str]:
    """The names autocast rounds in a spec model: each ``*.kernel`` and the ``*.bias`` beside
    it (a dense or convolution layer); a layer norm's ``scale``/``bias`` and the embeddings
    are used in float32."""
    names = list(names)
    layers = {n[:-len("kernel")] for n in names if n.endswith("kernel")}
    return {n for n in names
            if n.endswith("kernel") or n.endswith("bias") and n[:-len("bias")] in layers}


class ComputeGather:
    """``(unit, shard) -> the unit's gathered buffers`` for ``ShardedParameters``, and where
    each parameter lies in them (:attr:`places`).

    Args:
        torch, hvd: the modules.
        layouts: each unit's ``toolkit.parallel.shards.FlatLayout``.
        rank: this rank's shard (its place in ``process_set``).
        compute: the torch compute dtype, or ``None``: one buffer, the unit's padded buffer
            gathered as it is (also what stages 1 and 2 hold).
        rounded: the names the arithmetic rounds to ``compute`` (``rounded_names``).
        device: where the index tensors live.
        process_set: the Horovod process set the shards are gathered over (None: all ranks).

    Attributes:
        places: per unit, per parameter (in the layout's order): ``(buffer, offset)``, the
            buffer 0 (the padded buffer, 16-bit under ``compute``) or 1 (the float32
            parameters' elements, one after the other).
    """

    def __init__(self, torch, hvd, layouts, rank: int, compute=None, rounded=frozenset(),
                 device=None, process_set=None):
        self.torch, self.hvd, self.compute = torch, hvd, compute
        # (the shards' group: the global set, or a replica's under HSDP)
        self._in = {} if process_set is None else {"process_set": process_set}
        self.kept: list = []  # per unit: my shard's positions of the float32 ones, or None
        self.places: list[list[tuple[int, int]]] = []
        for fl in layouts:
            places, where, at = [], [], 0
            for name, o, n in zip(fl.names, fl.offsets, fl.sizes, strict=True):
                if compute is None or name in rounded:
                    places.append((0, o))
                else:
                    places.append((1, at))
                    where.append(np.arange(o, o + n))
                    at += n
            self.places.append(places)
            if not where:
                self.kept.append(None)
                continue
            where = np.concatenate(where)  # ascending: the buffer's order, so rank order too
            lo = rank * fl.shard_size
            mine = where[(where >= lo) & (where < lo + fl.shard_size)] - lo
            self.kept.append(torch.as_tensor(mine, device=device))

    def __call__(self, unit: int, shard) -> tuple:
        if self.compute is None:
            return (self.hvd.allgather(shard, name=f"zero.gather.{unit}", **self._in),)
        # (sent as its 16-bit patterns: Horovod's torch collectives take no bfloat16)
        low = self.hvd.allgather(shard.to(self.compute).view(self.torch.int16),
                                 name=f"zero.gather.{unit}", **self._in).view(self.compute)
        mine = self.kept[unit]
        if mine is None:
            return (low,)
        return low, self.hvd.allgather(shard[mine], name=f"zero.gather.float.{unit}",
                                       **self._in)
