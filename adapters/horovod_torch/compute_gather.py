"""ZeRO-3's all-gathers in the compute dtype (FSDP2's ``MixedPrecisionPolicy.param_dtype``)
for ``horovod-torch`` under bf16-mixed and fp16-mixed, with the arithmetic unchanged.

A spec model's forward under ``torch.autocast`` rounds the kernels and biases of its dense and
convolution layers to the compute dtype (``addmm``, ``conv``) and uses its embeddings and layer
norms' parameters in float32 (a lookup, and the contract's float32 statistics). So a unit's
shard is sent in the compute dtype and widened on arrival (half the bytes in bfloat16), and
the elements of the parameters used in float32 come in a second, float32 all-gather, written
over their rounded copies: every parameter then holds the value the arithmetic reads, bit for
bit what gathering in float32 gave. The gradient's reduce-scatter stays float32 (FSDP2's
``reduce_dtype``). A module of your own is gathered in float32: which of its parameters
autocast rounds is its forward's business, not the toolkit's to guess.
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
    """``(unit, shard) -> the unit's padded flat buffer`` for ``ShardedParameters`` (stage 3).

    Args:
        torch, hvd: the modules.
        layouts: each unit's ``toolkit.parallel.shards.FlatLayout``.
        rank: this rank.
        compute: the torch compute dtype, or ``None``: one plain all-gather per unit.
        rounded: the names the arithmetic rounds to ``compute`` (``rounded_names``).
        device: where the index tensors live.
    """

    def __init__(self, torch, hvd, layouts, rank: int, compute=None, rounded=frozenset(),
                 device=None):
        self.torch, self.hvd, self.compute = torch, hvd, compute
        self.kept: list[tuple | None] = []  # per unit: (positions in my shard, in the buffer)
        for fl in layouts:
            where = [np.arange(o, o + n) for name, o, n in zip(fl.names, fl.offsets, fl.sizes,
                                                                strict=True)
                     if name not in rounded]
            if not where:
                self.kept.append(None)
                continue
            where = np.concatenate(where)  # ascending: the buffer's order, so rank order too
            lo = rank * fl.shard_size
            mine = where[(where >= lo) & (where < lo + fl.shard_size)] - lo
            self.kept.append((torch.as_tensor(mine, device=device),
                              torch.as_tensor(where, device=device)))
    def __call__(self, unit: int, shard):
        if self.compute is None:
            return self.hvd.allgather(shard, name=f"zero.gather.{unit}")
        # (sent as its 16-bit patterns: Horovod's torch collectives take no bfloat16)
        low = self.hvd.allgather(shard.to(self.compute).view(self.torch.int16),
                                 name=f"zero.gather.{unit}")
        full = low.view(self.compute).to(shard.dtype)
        kept = self.kept[unit]
        if kept is not None:
            mine, where = kept
            full[where] = self.hvd.allgather(shard[mine], name=f"zero.gather.float.{unit}")
        return full
