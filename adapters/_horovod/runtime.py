"""The Horovod runtime both Horovod backends share: ``hvd.init`` with the layout's process sets,
host-side collectives, and the check that Horovod agrees with the launcher.

A ``toolkit.Pipeline`` averages gradients in Horovod process sets (each stage's replicas, the
end stages holding a tied embedding: ``toolkit.PipelineGrid.reduction_groups`` of the
layout's ``grid``). Horovod's static sets must be given to the first ``hvd.init``, which is
why the layout comes with ``setup``. A framework's runtime
(``adapters/horovod_torch/runtime.py``, ``adapters/horovod_tf`` ...) imports its framework and
its Horovod module in ``connect`` and says how a host array becomes the framework's tensor
(``tensor``).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

from adapters._common import check_world, missing_framework
from toolkit import ToolkitError
from toolkit.launch.cli import close_on_input_error
from toolkit.launch.devices import choose_device
from toolkit.models.specs import DTYPES, check_choice


def layout_groups(layout: Any, world_size: int) -> tuple[tuple[int, ...], ...]:
    """The rank groups ``layout``'s collectives run in, leaving out single ranks and the whole
    world: a ``toolkit.Pipeline``'s (``PipelineGrid.reduction_groups``), else its dimensions'
    data-parallel groups and replica groups (HSDP: shards within a group, each shard
    averaged across the replicas)."""
    if layout.dims.pipeline is not None:  # (a pipeline's data dimension: its replicas)
        return layout.dims.staged().grid(world_size).reduction_groups()
    grid = layout.dims.grid(world_size)
    return tuple(g for axis in ("data", "replicate") for g in grid.groups(axis)
                 if 1 < len(g) < world_size)


@dataclasses.dataclass(frozen=True)
class ShardGroup:
    """Where this rank's ZeRO shards sit: shard ``index`` of ``size`` over the process set
    ``shards`` (the global one unless the layout has replicas), and ``replicas``, the set of
    the ranks holding the same shard (None: no replicas), whose gradients it averages across.
    ``writes``: whether this rank writes its checkpoint pieces (the first replica's ranks: the
    others hold copies)."""

    index: int
    size: int
    shards: Any
    replicas: Any
    writes: bool


def init_horovod(hvd, layout: Any, world_size: int) -> dict[tuple[int, ...], Any]:
    """``hvd.init()``, registering as static process sets the rank groups ``layout`` reduces
    gradients in (:func:`layout_groups`: a ``toolkit.Pipeline``'s stage replicas and end
    stages, a composed layout's shard and replica groups); returns them as
    ``{ranks: hvd.ProcessSet}``.

    Horovod fixes its static sets at the first ``hvd.init`` (so the layout comes with
    ``setup``). If Horovod was initialised before (by the user's script or
    an earlier Trainer), a group not registered then is added dynamically, which Horovod allows
    only when ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` was set before that first init."""
    groups = layout_groups(layout, world_size)
    if not hvd.is_initialized():
        sets = [hvd.ProcessSet(list(g)) for g in groups]
        hvd.init(process_sets=sets)
        return dict(zip(groups, sets, strict=True))
    found = {}
    for g in groups:
        ps = hvd.ProcessSet(list(g))
        try:
            hvd.init(process_sets=[ps])  # finds a set registered before
        except KeyError:
            try:
                ps = hvd.add_process_set(list(g))
            except ValueError as err:
                raise ToolkitError(
                    f"{layout} averages gradients in the Horovod process set of ranks "
                    f"{list(g)}, but Horovod was initialised before without it ({err})",
                    "let the Trainer initialise Horovod (do not call hvd.init() before it), "
                    "or export HOROVOD_DYNAMIC_PROCESS_SETS=1 before your hvd.init()") from err
        found[g] = ps
    return found


COMPRESSIONS = ("none", "fp16")


class HorovodRuntime:
    """Horovod's communicator for one framework (a subclass imports it: ``connect``)."""

    backend = "horovod"  # the backend's name, for errors
    hvd: Any = None
    env: Any = None

    def __init__(self, dtype: str = "float32", compression: str = "none"):
        check_choice("dtype", dtype, DTYPES)
        check_choice("compression", compression, COMPRESSIONS)
        self.dtype_name = dtype
        # "fp16": the data-parallel gradient allreduce carries float16 (Horovod's
        # Compression.fp16: half the bytes; the sums rounded to float16)
        self.compression = compression
        self.process_sets: dict[tuple[int, ...], Any] = {}

    def compressor(self) -> Any:
        """Horovod's compression of the gradient allreduce (``hvd.Compression``)."""
        return getattr(self.hvd.Compression, self.compression)

    def setup(self, env, layout: Any, device: str = "auto") -> None:
        """Imports the framework (``connect``), chooses the rank's device (the GPU of its local
        rank: ``toolkit.launch.devices``) and has the framework use it (``use``), starts
        Horovod with ``layout``'s process sets and checks it agrees with ``env``."""
        if self.hvd is None:
            self.hvd = self.connect(env)
        self.env = env
        self.device = choose_device(device, self.visible_gpus(), env.local_rank, env.local_size)
        self.use(self.device)
        self.process_sets = init_horovod(self.hvd, layout, env.world_size)
        close_on_input_error(self.hvd.shutdown)
        check_world(self.backend, env, self.hvd.size(), self.hvd.rank())

    def connect(self, env) -> Any:
        """Imports the framework and its Horovod module (returned); sets thread counts."""
        raise NotImplementedError

    def visible_gpus(self) -> int:
        """GPUs the framework sees on this node (``CUDA_VISIBLE_DEVICES`` applied)."""
        raise NotImplementedError

    def use(self, device) -> None:
        """Makes ``device`` (a ``toolkit.launch.devices.Device``) the one the framework
        computes on, before Horovod starts (NCCL binds to the current GPU)."""
        raise NotImplementedError

    def missing(self, what: str, err: ImportError) -> ToolkitError:
        return missing_framework(self.backend, what, err)

    @staticmethod
    def threads(env) -> int:
        """Intra-op threads per rank: ranks on one node share its cores, and oversubscribed
        threads slow every rank."""
        return max(1, (os.cpu_count() or 1) // env.local_size)

    def tensor(self, values: np.ndarray) -> Any:
        """A host array as the framework's tensor."""
        raise NotImplementedError

    def allreduce(self, values: np.ndarray, op: str = "mean") -> np.ndarray:
        check_choice("reduction", op, ("mean", "sum"))
        hvd = self.hvd
        # Named: unnamed ops are numbered per process, and under a pipeline the ranks of
        # different stages have made different numbers of (process-set) ops.
        out = hvd.allreduce(self.tensor(np.asarray(values, np.float64)),
                            op=hvd.Average if op == "mean" else hvd.Sum, name="toolkit.allreduce")
        return np.asarray(out.numpy())

    def broadcast(self, values: np.ndarray, root: int = 0) -> np.ndarray:
        return np.asarray(self.hvd.broadcast(self.tensor(np.asarray(values)), root_rank=root,
                                             name="toolkit.broadcast").numpy())

    def barrier(self) -> None:
        self.hvd.barrier()

    def shutdown(self) -> None:
        self.hvd.shutdown()

    def process_set(self, ranks: tuple[int, ...]) -> Any:
        """The Horovod process set of ``ranks`` registered at ``setup`` (None if none; the
        global set for every rank)."""
        if len(ranks) == self.env.world_size:
            return self.hvd.global_process_set
        return self.process_sets.get(tuple(ranks))

    def shard_group(self, layout: Any) -> ShardGroup:
        """This rank's :class:`ShardGroup` under ``layout`` (its dimensions' data axis, and
        the replicas of a composed layout)."""
        grid, rank = layout.dims.grid(self.env.world_size), self.env.rank
        coords, replicas = grid.coords(rank), grid.group(rank, "replicate")
        return ShardGroup(coords["data"], grid.extent("data"),
                          self.process_set(grid.group(rank, "data")),
                          self.process_set(replicas) if len(replicas) > 1 else None,
                          coords["replicate"] == 0)

    def local_device_count(self) -> int:
        return 1

    def device_names(self) -> list[str]:
        return [str(self.device)]
