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
import numbers
import re
from typing import ClassVar

from toolkit.errors import ToolkitError
from toolkit.parallel.pipeline.partition import (
    WITHIN_NODE,
    PipelineGrid,
    check_within_node,
    micro_batch_size,
)

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
LAYOUT_FORMS = ("data, sharded:1|2|3[:tpN], "
                "pipeline:STAGES:MICRO_BATCHES[:gpipe|1f1b|interleaved-1f1b[:CHUNKS]]"
                "[:within-node=stages|replicas]")
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


Layout = DataParallel | Sharded | Pipeline


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
    may end with ``:within-node=stages|replicas`` (``Pipeline.within_node``). A layout's
    ``name`` parses back to an equal layout.

    Example:
        >>> parse_layout("pipeline:2:4") == Pipeline(stages=2, micro_batches=4, schedule="1f1b")
        True
        >>> parse_layout("pipeline:2:4:gpipe:within-node=replicas").name
        'pipeline:2:4:gpipe:within-node=replicas'
    """
    named = [k for k in re.split(r"[^a-z_]+", str(text).lower()) if k in KINDS]
    if len(named) > 1:  # (pipeline:2:2,sharded:1, sharded:3+pipeline:2, ...)
        raise ToolkitError(
            f"layout {text!r} combines {' and '.join(dict.fromkeys(named))}: a layout is one "
            "of data parallel, sharded (with tensor parallelism inside: sharded:Z:tpN) or "
            "pipeline; they do not combine yet", f"write one of: {LAYOUT_FORMS}")
    parts = str(text).strip().lower().split(":")
    kind = parts[0]
    if kind in ("data", "data_parallel", "dp") and len(parts) == 1:
        return DataParallel()
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
