"""Parallel layouts as plain data: what the Trainer hands to a backend's adapter.

- ``DataParallel()``: every rank holds the whole model and optimizer state (the default).
- ``Sharded(stage)``: ZeRO stage 1 shards the optimizer state over the ranks, stage 2 also the
  gradients, stage 3 also the parameters (= FSDP's full sharding).
- ``Pipeline(stages, micro_batches, schedule, chunks, within_node)``: the model cut into
  ``stages`` pieces; ``S x D`` ranks are ``D`` data-parallel replicas of an ``S``-stage
  pipeline, a replica's stages on neighbouring ranks (or, ``within_node="replicas"``, a
  stage's replicas).

``parse_layout`` reads the command-line form (``data``, ``sharded:3``, ``pipeline:4:8:1f1b``)
and every layout's ``name`` writes it back (``data_parallel`` for data parallel), so a manifest
records the layout a run used. Every layout says what each rank holds (``holds``: the start-up
block's placement table).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import ClassVar

from toolkit.errors import ToolkitError
from toolkit.parallel.dims import Grid
from toolkit.parallel.pipeline.partition import (
    WITHIN_NODE,
    PipelineGrid,
    check_within_node,
    micro_batch_size,
)

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
LAYOUT_FORMS = ("data, sharded:1|2|3[:tpN], "
                "pipeline:STAGES:MICRO_BATCHES[:gpipe|1f1b|interleaved-1f1b[:CHUNKS]]"
                "[:within-node=stages|replicas], or dimensions joined with +: "
                "pipeline:S:M+sharded:Z[:gather=micro-batch]+tensor:T+replicate:R[+place:tensor:data:pipeline:"
                "replicate]")
KINDS = ("data", "data_parallel", "dp", "sharded", "pipeline")


@dataclasses.dataclass(frozen=True)
class DataShare:
    """Which share of every global batch a process loads: the global batch is cut into
    ``count`` equal shares (the sampler's strided partition) and this process loads share
    ``index``. Processes that hold pieces of one model replica (the stages of a pipeline, the
    tensor-parallel group of a ``model`` axis that spans processes) load the same share.

    Example (4 processes of 1 device, tensor parallel over 2: two data shares):
        >>> Sharded(stage=3, tensor_parallel=2).data_share(4, rank=3)
        DataShare(count=2, index=1)
    """

    count: int
    index: int


def _span(word: str, first: int, count: int) -> str:
    """``replica 3`` or, for several consecutive ones, ``replicas 2-3``."""
    return f"{word} {first}" if count == 1 else f"{word}s {first}-{first + count - 1}"


def _positive_int(owner: str, field: str, value: object, example: str) -> int:
    """``value`` as an int when it is a positive integer (not a bool), else a ToolkitError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ToolkitError(f"{owner} {field}={value!r} must be a positive integer",
                           f"e.g. {example}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class DataParallel:
    """Every rank holds the whole model; gradients are averaged with an all-reduce."""

    kind: ClassVar[str] = "data_parallel"  # what a backend declares it runs (adapter.layouts)
    # Whether ranks take part in each other's forward pass (parameters gathered, activations
    # passed): then every rank runs every evaluation call and writes its own checkpoint pieces.
    collective_forward: ClassVar[bool] = False

    @property
    def name(self) -> str:
        return "data_parallel"

    def data_share(self, world_size: int, rank: int, local_devices: int = 1) -> DataShare:
        """Every process loads its own share."""
        return DataShare(world_size, rank)

    def describe(self, world_size: int, local_devices: int = 1) -> str:
        """The layout in words, on ``world_size`` processes of ``local_devices`` each."""
        return f"data parallel over {world_size * local_devices} device(s)"

    def holds(self, world_size: int, rank: int, local_devices: int = 1) -> str:
        """What ``rank`` holds: a whole replica per device (``replicas 2-3``)."""
        return _span("replica", rank * local_devices, local_devices)

    def micro_batch(self, local_batch: int, accumulation_steps: int = 1) -> int:
        """Samples per forward pass: the local batch over the accumulation steps."""
        return local_batch // accumulation_steps

    @property
    def dims(self) -> ParallelDims:
        """The layout as dimensions: none but the data-parallel one."""
        return ParallelDims()


@dataclasses.dataclass(frozen=True)
class Sharded:
    """ZeRO / FSDP: state sharded over the data-parallel ranks.

    Args:
        stage: 1 shards the optimizer state, 2 also the gradients, 3 also the parameters.
        tensor_parallel: ranks that split each layer's matrices (1: none).
    """

    stage: int
    tensor_parallel: int = 1
    kind: ClassVar[str] = "sharded"
    collective_forward: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if isinstance(self.stage, bool) or self.stage not in (1, 2, 3):
            raise ToolkitError(
                f"Sharded stage={self.stage!r} is not a ZeRO stage",
                "use 1 (optimizer state), 2 (+ gradients) or 3 (+ parameters, = FSDP)")
        object.__setattr__(self, "stage", int(self.stage))
        object.__setattr__(self, "tensor_parallel", _positive_int(
            "Sharded", "tensor_parallel", self.tensor_parallel, "Sharded(stage=3)"))

    @property
    def name(self) -> str:
        tp = f":tp{self.tensor_parallel}" if self.tensor_parallel > 1 else ""
        return f"sharded:{self.stage}{tp}"

    def data_share(self, world_size: int, rank: int, local_devices: int = 1) -> DataShare:
        """The share of process ``rank`` of ``world_size`` (each driving ``local_devices``).

        The devices form a ``(data, model)`` mesh, process-major: a tensor-parallel group is
        ``tensor_parallel`` consecutive devices. When a group fits in a process, every process
        holds whole groups and loads its own share; when it spans ``g`` processes, those ``g``
        consecutive processes compute one replica and load the same share.
        """
        k, local = self.tensor_parallel, local_devices
        devices = world_size * local
        fits = [d for d in range(1, devices + 1)
                if devices % d == 0 and (local % d == 0 or d % local == 0)]
        hint = f"use one of {fits} ({world_size} process(es) x {local} device(s))"
        if devices % k:
            raise ToolkitError(f"tensor_parallel={k} does not divide the {devices} devices",
                               hint)
        if (local % k if k <= local else k % local):
            raise ToolkitError(
                f"tensor_parallel={k} cuts the {local} devices of a process into uneven model "
                "groups", hint + ": a group lies inside one process or spans whole processes")
        if k <= local:
            return DataShare(world_size, rank)
        group = k // local
        return DataShare(world_size // group, rank // group)

    def describe(self, world_size: int, local_devices: int = 1) -> str:
        """The layout in words, e.g. ``sharded:3 (ZeRO-3) over data=2 x model=2``."""
        k = self.tensor_parallel
        model = f" x model={k}" if k > 1 else ""
        return (f"{self.name} (ZeRO-{self.stage}) over data={world_size * local_devices // k}"
                f"{model}")

    def holds(self, world_size: int, rank: int, local_devices: int = 1) -> str:
        """What ``rank`` holds: the shard of its devices' data index (``shards 2-3``) and,
        with tensor parallelism, its devices' parts of the split matrices."""
        k, first, local = self.tensor_parallel, rank * local_devices, local_devices
        if k == 1:
            return _span("shard", first, local)
        shards = max(1, local // k)  # the data indices of the (data, model) mesh it holds
        return (f"{_span('shard', first // k, shards)}, "
                f"{_span('tensor part', first % k, min(k, local))}")

    def micro_batch(self, local_batch: int, accumulation_steps: int = 1) -> int:
        """Samples per forward pass: the local batch over the accumulation steps."""
        return local_batch // accumulation_steps

    @property
    def dims(self) -> ParallelDims:
        """The layout as dimensions: the data-parallel one sharded at ``stage``, and a tensor
        dimension of ``tensor_parallel`` inside it (on consecutive devices)."""
        return ParallelDims(zero=self.stage, tensor=self.tensor_parallel)


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """The model cut into ``stages`` consecutive pieces, fed ``micro_batches`` per step.

    Args:
        stages: pipeline stages ``S``.
        micro_batches: micro-batches ``M`` each step's batch is cut into.
        schedule: ``gpipe`` (all forwards, then all backwards), ``1f1b`` (one forward, one
            backward in the steady state) or ``interleaved-1f1b`` (``chunks`` model pieces per
            rank).
        chunks: model chunks per rank; more than 1 only with ``interleaved-1f1b``.
        splits: explicit split points, the first layer of every piece but the first
            (``stages x chunks - 1`` increasing indices); empty: balanced by parameter count.
            Not part of ``name`` (a checkpoint is the same whatever the cut).
        within_node: the axis placed on neighbouring ranks, so inside a node: ``"stages"`` (a
            replica's stages: activations stay inside a node, each stage's gradient allreduce
            crosses nodes) or ``"replicas"`` (a stage's replicas: the allreduce stays inside a
            node, activations cross). Text form ``:within-node=replicas``. Checkpoints do not
            depend on it. See ``toolkit.PipelineGrid``.
    """

    stages: int
    micro_batches: int
    schedule: str = "1f1b"
    chunks: int = 1
    splits: tuple[int, ...] = ()
    within_node: str = "stages"
    kind: ClassVar[str] = "pipeline"
    collective_forward: ClassVar[bool] = True

    def __post_init__(self) -> None:
        example = "Pipeline(stages=4, micro_batches=8)"
        for field in ("stages", "micro_batches", "chunks"):
            object.__setattr__(self, field,
                               _positive_int("Pipeline", field, getattr(self, field), example))
        if self.schedule not in SCHEDULES:
            raise ToolkitError(f"unknown pipeline schedule {self.schedule!r}",
                               f"use one of: {', '.join(SCHEDULES)}")
        if self.chunks > 1 and self.schedule != "interleaved-1f1b":
            raise ToolkitError(
                f"Pipeline chunks={self.chunks} needs the interleaved-1f1b schedule, "
                f"not {self.schedule!r}",
                "use schedule='interleaved-1f1b' or chunks=1")
        splits = tuple(self.splits) if isinstance(self.splits, tuple | list) else (None,)
        pieces = self.stages * self.chunks
        if splits and (len(splits) != pieces - 1 or any(
                isinstance(p, bool) or not isinstance(p, numbers.Integral) for p in splits)
                or any(a >= b for a, b in zip((0, *splits), splits, strict=False))):
            raise ToolkitError(
                f"Pipeline splits={self.splits!r} are not {pieces - 1} increasing positive layer "
                f"indices", f"give the first layer of each of the {pieces} pieces but the first, "
                f"e.g. splits={tuple(range(1, pieces))}, or none to balance by size")
        object.__setattr__(self, "splits", tuple(int(p) for p in splits))
        check_within_node(self.within_node)

    @property
    def name(self) -> str:
        chunks = f":{self.chunks}" if self.chunks > 1 else ""
        node = f":within-node={self.within_node}" if self.within_node != WITHIN_NODE[0] else ""
        return f"pipeline:{self.stages}:{self.micro_batches}:{self.schedule}{chunks}{node}"

    def grid(self, world_size: int, per_rank: int = 1) -> PipelineGrid:
        """Which rank (or, with ``per_rank`` devices each, which device) holds which stage
        of which replica: the one mapping every backend uses."""
        return PipelineGrid(world_size, self.stages, self.within_node, per_rank)

    def data_share(self, world_size: int, rank: int, local_devices: int = 1) -> DataShare:
        """Every rank of a replica loads the replica's share (stage 0 uses the inputs, the
        last stage the labels): ``D = world_size / stages`` shares."""
        grid = self.grid(world_size)
        return DataShare(grid.replicas, grid.replica_of(rank))

    def describe(self, world_size: int, local_devices: int = 1) -> str:
        """The layout in words: the stage grid and the schedule."""
        chunks = f", {self.chunks} chunks per stage" if self.chunks > 1 else ""
        return (f"pipeline of {self.stages} stages x {world_size // self.stages} replica(s), "
                f"{self.micro_batches} micro-batches, {self.schedule}{chunks}")

    def holds(self, world_size: int, rank: int, local_devices: int = 1) -> str:
        """What ``rank`` holds, e.g. ``replica 1, stage 0`` (its devices: consecutive
        replicas of one stage)."""
        grid = self.grid(world_size * local_devices, local_devices)
        first = rank * local_devices
        return (f"{_span('replica', grid.replica_of(first), local_devices)}, "
                f"stage {grid.stage_of(first)}")

    def micro_batch(self, local_batch: int, accumulation_steps: int = 1) -> int:
        """Samples per forward pass: the replica's batch over the schedule's micro-batches
        (a ToolkitError when they do not divide it)."""
        return micro_batch_size(local_batch, self.micro_batches)

    @property
    def dims(self) -> ParallelDims:
        """The layout as dimensions: the pipeline and its replicas (the data-parallel
        dimension), ``within_node`` the one placed on consecutive ranks."""
        inner = ("pipeline", "data") if self.within_node == "stages" else ("data", "pipeline")
        return ParallelDims(pipeline=dataclasses.replace(self, within_node=WITHIN_NODE[0]),
                            place=("tensor", *inner, "replicate"))


AXES = ("tensor", "data", "pipeline", "replicate")
GATHERS = ("step", "micro-batch")
"""The dimensions of a layout, innermost first: the default placement (``ParallelDims.place``)."""


@dataclasses.dataclass(frozen=True)
class ParallelDims:
    """A layout as a set of dimensions whose product is the world's devices (torchtitan's
    ``ParallelDims``): a ``pipeline`` of stages, a data-parallel dimension whose state is
    sharded at ZeRO stage ``zero`` (0: replicated, plain data parallelism), ``replicate``
    copies of those shards (HSDP: shard inside a group, replicate across groups; needs
    ``zero``), and ``tensor`` parts of each split layer. The data-parallel dimension takes the
    devices the others leave: ``devices / (stages x tensor x replicate)``.

    Args:
        pipeline: a ``Pipeline`` (its ``within_node`` left at the default: ``place`` says
            where the stages sit), or None.
        zero: the ZeRO stage of the data-parallel dimension (0-3).
        replicate: copies of the sharded state (1: none).
        tensor: devices each split layer is cut over (1: none).
        place: the four axes ``tensor``, ``data``, ``pipeline``, ``replicate`` in placement
            order, innermost first: the first on consecutive devices (inside a node), the
            last across nodes. The default keeps the tensor axis inside a node, the data
            shards next, the stages across nodes and the replicas outermost.
        gather: when a pipeline's ZeRO-3 stage gathers its parameters (and ZeRO-2/3
            reduce-scatter their gradients): ``step`` (once per step: the gathered
            parameters and a full gradient held while the step's micro-batches run) or
            ``micro-batch`` (around each micro-batch's forward and backward: the least
            memory, ``M`` times the collectives). Text form ``sharded:3:gather=micro-batch``.

    The command-line form joins the dimensions with ``+``: ``pipeline:2:4+sharded:3``,
    ``sharded:3+replicate:2``, ``sharded:1+tensor:2``, ``pipeline:2:4+tensor:2``, and
    ``+place:data:tensor:pipeline:replicate`` for another placement. A composition of one
    dimension is the layout of that kind (``ParallelDims(zero=3).simple() == Sharded(3)``).

    Example (pipeline 2 x ZeRO-3 over 2 shards on 4 ranks):
        >>> dims = parse_layout("pipeline:2:4+sharded:3")
        >>> dims.name, dims.data_share(4, rank=3)
        ('pipeline:2:4:1f1b+sharded:3', DataShare(count=2, index=1))
        >>> dims.holds(4, rank=3)
        'stage 1, shard 1'
    """

    pipeline: Pipeline | None = None
    zero: int = 0
    replicate: int = 1
    tensor: int = 1
    place: tuple[str, ...] = AXES
    gather: str = GATHERS[0]
    collective_forward: ClassVar[bool] = True

    def __post_init__(self) -> None:
        example = "ParallelDims(zero=3, replicate=2)"
        if self.gather not in GATHERS:
            raise ToolkitError(f"gather={self.gather!r} is not when a stage gathers",
                               f"use one of: {', '.join(GATHERS)}")
        if self.gather != GATHERS[0] and (self.pipeline is None or not self.zero):
            raise ToolkitError(
                f"gather={self.gather} chooses when a pipeline's ZeRO stage gathers per "
                "micro-batch, but this layout has no pipeline with ZeRO",
                "e.g. pipeline:2:4+sharded:3:gather=micro-batch, or drop gather=")
        if isinstance(self.zero, bool) or self.zero not in (0, 1, 2, 3):
            raise ToolkitError(f"ParallelDims zero={self.zero!r} is not a ZeRO stage",
                               "use 0 (replicated), 1 (optimizer state), 2 (+ gradients) or "
                               "3 (+ parameters, = FSDP)")
        for field in ("replicate", "tensor"):
            object.__setattr__(self, field, _positive_int("ParallelDims", field,
                                                          getattr(self, field), example))
        if self.pipeline is not None and not isinstance(self.pipeline, Pipeline):
            raise ToolkitError(f"ParallelDims pipeline={self.pipeline!r} is not a Pipeline",
                               "pass toolkit.Pipeline(stages, micro_batches) or None")
        if self.pipeline is not None and self.pipeline.within_node != WITHIN_NODE[0]:
            raise ToolkitError(
                f"a composed layout places its stages with place:, not the pipeline's "
                f"within_node={self.pipeline.within_node!r}",
                "e.g. pipeline:2:4+sharded:3+place:tensor:pipeline:data:replicate puts a "
                "replica's stages inside a node")
        place = tuple(self.place)
        if sorted(place) != sorted(AXES):
            raise ToolkitError(f"place:{':'.join(map(str, place))} is not an order of the "
                               f"axes {', '.join(AXES)}",
                               f"name each once, innermost first, e.g. place:{':'.join(AXES)}")
        object.__setattr__(self, "place", place)
        if self.replicate > 1 and not self.zero:
            raise ToolkitError(
                f"replicate:{self.replicate} copies sharded state, but this layout shards "
                "nothing", "write sharded:Z+replicate:R (HSDP: ZeRO-Z inside each group, "
                "R groups), or drop replicate: data parallelism already replicates")

    # ------------------------------------------------------------------ the dimensions
    @property
    def stages(self) -> int:
        return 1 if self.pipeline is None else self.pipeline.stages

    @property
    def kind(self) -> str:
        """The layout kind a backend dispatches on: its pipeline, else its sharded or tensor
        dimension, else data parallel."""
        if self.pipeline is not None:
            return Pipeline.kind
        return Sharded.kind if self.zero or self.tensor > 1 else DataParallel.kind

    @property
    def active(self) -> tuple[str, ...]:
        """The dimensions this layout has beyond plain data parallelism, as its text names
        them (``pipeline``, ``sharded``, ``tensor``, ``replicate``)."""
        named = (("pipeline", self.pipeline is not None), ("sharded", self.zero > 0),
                 ("tensor", self.tensor > 1), ("replicate", self.replicate > 1))
        return tuple(n for n, on in named if on)

    @property
    def dims(self) -> ParallelDims:
        return self

    @property
    def name(self) -> str:
        simple = self.simple()
        if simple is not self:
            return simple.name
        parts = [self.pipeline.name] if self.pipeline is not None else []
        gather = f":gather={self.gather}" if self.gather != GATHERS[0] else ""
        parts += [f"sharded:{self.zero}{gather}"] if self.zero else ([] if parts else ["data"])
        parts += [f"tensor:{self.tensor}"] if self.tensor > 1 else []
        parts += [f"replicate:{self.replicate}"] if self.replicate > 1 else []
        if self.place != AXES:
            parts.append(f"place:{':'.join(self.place)}")
        return "+".join(parts)

    def simple(self) -> Layout:
        """The one-kind layout equal to this composition (``data``, ``sharded:Z[:tpN]``,
        ``pipeline:S:M``), or the composition itself."""
        if self.replicate == 1 and self.pipeline is None:
            if not self.zero:
                return self if self.tensor > 1 else DataParallel()
            # (Sharded's tensor groups are consecutive devices: tensor inside data)
            if self.tensor == 1 or self.place.index("tensor") < self.place.index("data"):
                return Sharded(self.zero, self.tensor)
        if self.pipeline is not None and self.active == ("pipeline",):
            return self.staged()
        return self

    def staged(self) -> Pipeline:
        """The pipeline, its ``within_node`` the placement's (a stage's data-parallel ranks
        are its ``Pipeline`` replicas): the grid a pipeline executor runs on. A ToolkitError
        without a pipeline, or with replicas or tensor parts the pipeline grid has no place
        for."""
        if self.pipeline is None or self.replicate > 1 or self.tensor > 1:
            raise ToolkitError(f"layout {self.name} has no stage grid of (stage, replica) "
                               "alone", "compose a pipeline with data or sharded:Z only")
        stages_inside = self.place.index("pipeline") < self.place.index("data")
        return dataclasses.replace(self.pipeline, within_node=WITHIN_NODE[
            0 if stages_inside else 1])

    def grid(self, world_size: int, local_devices: int = 1) -> Grid:
        """The world's devices on the four axes (the data axis takes what the others leave);
        a ToolkitError naming the dimension that does not fit, with the sizes that would."""
        devices = world_size * local_devices
        fixed = [("pipeline", self.stages), ("tensor", self.tensor),
                 ("replicate", self.replicate)]
        product = 1
        for axis, n in fixed:
            if devices % (product * n):
                others = devices // math.gcd(devices, product)
                fits = [k for k in range(1, others + 1) if others % k == 0 and
                        devices % (product * k) == 0]
                raise ToolkitError(
                    f"layout {self.name}: {axis} {n} does not fit the {devices} devices "
                    f"({world_size} process(es) x {local_devices})"
                    + (f" beside {product} taken by the dimensions before it" if product > 1
                       else ""), f"use {axis} one of {fits}, or launch a multiple of "
                    f"{product * n} devices")
            product *= n
        sizes = {"pipeline": self.stages, "tensor": self.tensor, "replicate": self.replicate,
                 "data": devices // product}
        return Grid(tuple((a, sizes[a]) for a in reversed(self.place)))

    def _process_grid(self, world_size: int, local_devices: int) -> Grid:
        """:meth:`grid`, checked that every process's devices share one pipeline stage and
        either lie inside one tensor group or hold whole ones."""
        grid, L = self.grid(world_size, local_devices), local_devices
        for rank in range(world_size):
            devices = range(rank * L, rank * L + L)
            stages = {grid.coords(d)["pipeline"] for d in devices}
            tensors = {grid.group(d, "tensor") for d in devices}
            whole = all(set(t) <= set(devices) for t in tensors)
            if len(stages) > 1 or not (whole or len(tensors) == 1):
                raise ToolkitError(
                    f"layout {self.name}: the {L} devices of a process fall on "
                    f"{len(stages)} stage(s) and cut tensor groups unevenly",
                    "a process's devices must hold one stage, and whole tensor groups or a "
                    "part of one: put tensor (then data) innermost in place:")
        return grid

    def _shares(self, grid: Grid, devices: range) -> list[int]:
        """The data shares (replica-major: ``replicate x data``) ``devices`` compute on."""
        D = grid.extent("data")
        return sorted({grid.coords(d)["replicate"] * D + grid.coords(d)["data"]
                       for d in devices})

    # ------------------------------------------------------------------ the Layout interface
    def data_share(self, world_size: int, rank: int, local_devices: int = 1) -> DataShare:
        """The devices that share a replica index and a data index compute on one share of
        each global batch (``replicate x data`` shares); a process whose devices compute on
        ``k`` consecutive shares loads them as one."""
        grid, L = self._process_grid(world_size, local_devices), local_devices
        total = grid.extent("replicate") * grid.extent("data")
        mine = self._shares(grid, range(rank * L, rank * L + L))
        k = len(mine)
        if mine != list(range(mine[0], mine[0] + k)) or mine[0] % k:
            raise ToolkitError(
                f"layout {self.name}: the devices of process {rank} compute on data shares "
                f"{mine}, not one aligned run", "put data next to tensor in place:, inside "
                "the pipeline and the replicas")
        return DataShare(total // k, mine[0] // k)

    def describe(self, world_size: int, local_devices: int = 1) -> str:
        """The layout in words, e.g. ``pipeline:2:4:1f1b+sharded:3 over stages=2 x
        shards=2`` (axes outermost first)."""
        grid = self.grid(world_size, local_devices)
        word = {"pipeline": "stages", "tensor": "tensor", "replicate": "replicas",
                "data": "shards" if self.zero else "replicas"}
        axes = " x ".join(f"{word[a]}={n}" for a, n in grid.axes if n > 1 or a == "data")
        return f"{self.name} over {axes}"

    def holds(self, world_size: int, rank: int, local_devices: int = 1) -> str:
        """What ``rank`` holds: its replica (HSDP), stage, shard (or data-parallel replica)
        and tensor part, each a span over its devices, e.g. ``replica 1, stage 0, shard 1``."""
        grid, L = self.grid(world_size, local_devices), local_devices
        coords = [grid.coords(d) for d in range(rank * L, rank * L + L)]
        words = (("replicate", "replica"), ("pipeline", "stage"),
                 ("data", "shard" if self.zero else "replica"), ("tensor", "tensor part"))
        out = [_span(word, min(c[axis] for c in coords), len({c[axis] for c in coords}))
               for axis, word in words if grid.extent(axis) > 1]
        return ", ".join(out) or "replica 0"

    def micro_batch(self, local_batch: int, accumulation_steps: int = 1) -> int:
        """Samples per forward pass: the pipeline's micro-batch, else the local batch over
        the accumulation steps."""
        if self.pipeline is not None:
            return self.pipeline.micro_batch(local_batch, accumulation_steps)
        return local_batch // accumulation_steps


Layout = DataParallel | Sharded | Pipeline | ParallelDims


def _int_field(text: str, part: str, what: str) -> int:
    try:
        return int(part)
    except ValueError:
        raise ToolkitError(f"layout {text!r}: {what} {part!r} is not an integer",
                           f"write one of: {LAYOUT_FORMS}") from None


def parse_layout(text: str) -> Layout:
    """The layout the command-line form ``text`` names.

    ``data`` (or ``data_parallel``), ``sharded:S``, ``pipeline:S:M``, ``pipeline:S:M:SCHEDULE``
    and, for the interleaved schedule, ``pipeline:S:M:interleaved-1f1b:CHUNKS``; a pipeline
    may end with ``:within-node=stages|replicas`` (``Pipeline.within_node``). Dimensions
    compose with ``+`` (:class:`ParallelDims`): ``pipeline:2:4+sharded:3``,
    ``sharded:3+replicate:2``, ``sharded:1+tensor:2``, ``...+place:AXES``; a pipeline's
    sharded dimension may end with ``:gather=micro-batch`` (:attr:`ParallelDims.gather`). A
    layout's ``name`` parses back to an equal layout.

    Example:
        >>> parse_layout("pipeline:2:4") == Pipeline(stages=2, micro_batches=4, schedule="1f1b")
        True
        >>> parse_layout("pipeline:2:4:gpipe:within-node=replicas").name
        'pipeline:2:4:gpipe:within-node=replicas'
        >>> parse_layout("sharded:3+tensor:2") == Sharded(3, tensor_parallel=2)
        True
    """
    if "," in str(text) and ":" in str(text):  # (pipeline:2:2,sharded:1)
        raise ToolkitError(f"layout {text!r}: dimensions are joined with +, not a comma",
                           f"e.g. {str(text).replace(',', '+')}")
    parts = [p.strip() for p in str(text).strip().lower().split("+")]
    if len(parts) == 1:
        return _parse_one(text, parts[0])
    fields: dict[str, object] = {}

    def put(field: str, value: object, part: str) -> None:
        if field in fields:
            raise ToolkitError(f"layout {text!r} gives {field} twice ({part!r})",
                               "name each dimension once, e.g. pipeline:2:4+sharded:3")
        fields[field] = value

    for part in parts:
        head, _, rest = part.partition(":")
        if head == "place" and rest:
            put("place", tuple(a.strip() for a in rest.split(":")), part)
        elif head in ("tensor", "tp", "replicate") and rest:
            put("replicate" if head == "replicate" else "tensor",
                _int_field(text, rest, f"{head} size"), part)
        elif head in KINDS:
            if head == "sharded" and ":gather=" in part:
                part, _, when = part.partition(":gather=")
                put("gather", when, part)
            one = _parse_one(text, part)
            if isinstance(one, Pipeline) and one.within_node != WITHIN_NODE[0]:
                raise ToolkitError(f"layout {text!r}: a composed layout places its stages "
                                   "with place:, not within-node=",
                                   "e.g. pipeline:2:4+sharded:3+place:tensor:pipeline:data:"
                                   "replicate puts a replica's stages inside a node")
            dims = one.dims
            if dims.pipeline is not None:
                put("pipeline", dims.pipeline, part)
            if dims.zero:
                put("zero", dims.zero, part)
            if dims.tensor > 1:
                put("tensor", dims.tensor, part)
        else:
            raise ToolkitError(f"layout {text!r}: unknown dimension {part!r}",
                               f"join dimensions with +: {LAYOUT_FORMS}")
    return ParallelDims(**fields).simple()  # type: ignore[arg-type]


def _parse_one(text: str, part: str) -> Layout:
    """One ``+``-free part of the text form ``text`` as its layout."""
    parts = part.split(":")
    kind = parts[0]
    if kind in ("data", "data_parallel", "dp") and len(parts) == 1:
        return DataParallel()
    if kind == "sharded" and len(parts) in (2, 3) and parts[-1].startswith("gather="):
        raise ToolkitError(f"layout {text!r}: gather= chooses when a pipeline's ZeRO stage "
                           "gathers", "compose it with a pipeline: pipeline:2:4+"
                           f"{part}")
    if kind == "sharded" and len(parts) in (2, 3):
        tp = 1
        if len(parts) == 3:
            if not parts[2].startswith("tp"):
                raise ToolkitError(f"layout {text!r}: expected tpN after the stage",
                                   "e.g. sharded:3 or sharded:3:tp2")
            tp = _int_field(text, parts[2][2:], "tensor-parallel size")
        return Sharded(_int_field(text, parts[1], "stage"), tp)
    if kind == "pipeline":
        options = dict(p.partition("=")[::2] for p in parts[1:] if "=" in p)
        parts = [p for p in parts if "=" not in p]
        if len(parts) in (3, 4, 5):
            return Pipeline(_int_field(text, parts[1], "stages"),
                            _int_field(text, parts[2], "micro-batches"),
                            parts[3] if len(parts) > 3 else "1f1b",
                            _int_field(text, parts[4], "chunks") if len(parts) > 4 else 1,
                            within_node=_within_node(text, options))
    raise ToolkitError(f"unknown layout {text!r}", f"write one of: {LAYOUT_FORMS}")


def _within_node(text: str, options: dict[str, str]) -> str:
    """The ``within-node=...`` option of a pipeline's text form (the only option)."""
    hint = "write within-node=stages (the default) or within-node=replicas"
    for key, value in options.items():
        if key.replace("_", "-") != "within-node":
            raise ToolkitError(f"layout {text!r}: unknown pipeline option {key!r}",
                               f"{hint}, e.g. pipeline:2:4:1f1b:within-node=replicas")
        if value not in WITHIN_NODE:
            raise ToolkitError(f"layout {text!r}: within-node={value!r} is not a pipeline axis",
                               f"{hint}: a replica's stages, or a stage's replicas, on "
                               "neighbouring ranks (inside a node)")
    return options.get("within-node", options.get("within_node", WITHIN_NODE[0]))


def resolve_layout(layout, adapter):
    """The layout as a spec (``None`` is data parallel; text is parsed); a clear error for
    one the backend ``adapter`` does not run (its ``layouts``: the layout kinds it declares;
    an adapter that declares none runs data parallelism)."""
    layout = DataParallel() if layout is None else (
        parse_layout(layout) if isinstance(layout, str) else layout)
    if isinstance(layout, ParallelDims):  # (one dimension: the layout of that kind)
        layout = layout.simple()
    if not isinstance(layout, Layout):
        raise ToolkitError(f"{layout!r} is not a parallel layout",
                           "pass toolkit.DataParallel(), toolkit.Sharded(stage=...) or a text "
                           "form such as 'sharded:3'")
    runs = tuple(getattr(adapter, "layouts", (DataParallel.kind,)))
    if layout.kind not in runs:
        raise ToolkitError(f"backend {adapter.name!r} cannot run layout {layout.name!r}",
                           f"{adapter.name} runs: {', '.join(runs)}; choose one of these, or "
                           "a backend that runs this layout (see the README's layouts)")
    return layout
