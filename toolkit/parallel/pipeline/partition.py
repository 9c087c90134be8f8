"""How a model is cut into pipeline stages, and the arithmetic of a pipeline's ranks (numpy-free).

A model is a sequence of *layers* (a GPT's blocks, an MLP's dense layers, the items of a
``torch.nn.Sequential``); a stage holds a contiguous run of them. ``partition_layers`` works on
per-layer costs only (parameter counts, say), so every backend maps its native sequential model
onto it by index; ``partition_model`` does the same for a spec model and names the parameters each
stage holds.

Interleaved schedules cut the model into ``S x v`` *chunks*: chunk ``k`` (the virtual stage ``k``)
lives on rank ``k % S`` as that rank's local chunk ``k // S``, Megatron-LM's placement.

A pipeline's ``S x D`` ranks are ``D`` data-parallel replicas of an ``S``-stage pipeline;
``PipelineGrid`` says which rank holds which ``(stage, replica)``. Launchers fill a node with
consecutive ranks, so the axis that runs over consecutive ranks stays within a node:
``within_node="stages"`` (the default) puts a replica's stages on consecutive ranks (rank
``r`` is stage ``r % S`` of replica ``r // S``: activations stay inside a node, the gradient
allreduce crosses nodes), ``"replicas"`` a stage's replicas (stage ``r // D`` of replica
``r % D``: the allreduce stays inside a node, activations cross).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence

from toolkit.errors import ToolkitError


def _count(what: str, value: object, example: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ToolkitError(f"{what}={value!r} must be a positive integer", f"e.g. {example}")
    return int(value)


def balanced_splits(costs: Sequence[float], parts: int) -> tuple[int, ...]:
    """The ``parts - 1`` split points that cut ``costs`` into contiguous runs with the smallest
    possible largest run (a min-max partition), the most even such cut among equals.

    Split point ``p`` starts a new run at layer ``p``. Exact: a dynamic program finds the smallest
    achievable maximum, a second one, among the cuts that achieve it, the one with the smallest
    sum of squared run costs (so equal layers cut into equal runs).

    Example:
        >>> balanced_splits([4, 1, 1, 1, 1, 4], 3)
        (1, 5)
    """
    parts = _count("parts", parts, "balanced_splits([3, 1, 1, 3], 2)")
    costs = [float(c) for c in costs]
    if any(c < 0 or math.isnan(c) for c in costs):
        raise ToolkitError(f"layer costs {costs} must be non-negative", "pass parameter counts")
    n = len(costs)
    if parts > n:
        raise ToolkitError(f"{parts} stages (or chunks) for a model of {n} layers",
                           f"use at most {n} stages, or a model with more layers")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = math.inf
    # best[k][i]: smallest largest run cutting the first i layers into k runs.
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            best[k][i] = min(max(best[k - 1][j], prefix[i] - prefix[j]) for j in range(k - 1, i))
    bound = best[parts][n] * (1 + 1e-12)
    # squares[k][i]: smallest sum of squared runs, every run within ``bound``.
    squares = [[inf] * (n + 1) for _ in range(parts + 1)]
    choice = [[0] * (n + 1) for _ in range(parts + 1)]
    squares[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                run = prefix[i] - prefix[j]
                # ``<=``: among equal cuts the latest, so a parameter-free layer (an activation
                # after its dense layer) stays with the layer before it.
                if run <= bound and squares[k - 1][j] + run * run <= squares[k][i]:
                    squares[k][i], choice[k][i] = squares[k - 1][j] + run * run, j
    splits, i = [], n
    for k in range(parts, 0, -1):
        i = choice[k][i]
        splits.append(i)
    return tuple(reversed(splits[:-1]))


def check_splits(splits: Sequence[int], num_layers: int, parts: int) -> tuple[int, ...]:
    """``splits`` as a tuple when they cut ``num_layers`` layers into ``parts`` non-empty runs."""
    splits = tuple(splits)
    if len(splits) != parts - 1:
        raise ToolkitError(
            f"{len(splits)} split points {list(splits)} for {parts} stages (or chunks)",
            f"give {parts - 1} increasing layer indices between 1 and {num_layers - 1}")
    previous = 0
    for p in splits:
        if isinstance(p, bool) or not isinstance(p, numbers.Integral):
            raise ToolkitError(f"split point {p!r} in {list(splits)} is not an integer",
                               "give layer indices, e.g. splits=(2,)")
        if not previous < p < num_layers:
            raise ToolkitError(
                f"split points {list(splits)} are out of range or not increasing at {p} "
                f"(a model of {num_layers} layers)",
                f"give {parts - 1} strictly increasing indices between 1 and {num_layers - 1}")
        previous = p
    return tuple(int(p) for p in splits)


def partition_layers(costs: Sequence[float], stages: int, chunks: int = 1,
                     splits: Sequence[int] | None = None) -> tuple[range, ...]:
    """Index ranges of the ``stages x chunks`` pieces a sequential model is cut into.

    Args:
        costs: one cost per layer (its parameter count), in the model's order.
        stages: pipeline stages ``S``.
        chunks: model chunks per stage ``v`` (interleaved schedules); piece ``k`` runs on stage
            ``k % S``. With ``v > 1`` and no ``splits`` the layer count must divide into
            ``S x v`` equal chunks (Megatron-LM's rule).
        splits: explicit split points (``S x v - 1`` increasing layer indices) instead of
            balancing by cost.

    Returns:
        ``S x v`` ranges, in the model's order.

    Example:
        >>> partition_layers([10, 10, 10, 10, 40], 2)
        (range(0, 4), range(4, 5))
    """
    stages = _count("stages", stages, "stages=2")
    chunks = _count("chunks", chunks, "chunks=2")
    n, parts = len(costs), stages * chunks
    if parts > n:
        what = f"{stages} stages" if chunks == 1 else f"{stages} stages x {chunks} chunks"
        raise ToolkitError(f"{what} for a model of {n} layers",
                           f"use at most {n} pieces, or a model with more layers")
    if splits is not None:
        cuts = check_splits(splits, n, parts)
    elif chunks > 1:
        if n % parts:
            raise ToolkitError(
                f"{n} layers do not split into {stages} stages x {chunks} chunks of equal size",
                f"use a layer count that is a multiple of {parts}, other chunks, or explicit "
                "split points")
        cuts = tuple(range(n // parts, n, n // parts))
    else:
        cuts = balanced_splits(costs, parts)
    bounds = (0, *cuts, n)
    return tuple(range(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True))


def _shapes_of(spec) -> dict[str, tuple[int, ...]]:
    if hasattr(spec, "param_shapes"):
        return dict(spec.param_shapes())
    if hasattr(spec, "sizes"):  # MLP: no need to draw its arrays
        shapes = {}
        for i, (a, b) in enumerate(zip(spec.sizes[:-1], spec.sizes[1:], strict=True)):
            shapes[f"layers.{i}.kernel"], shapes[f"layers.{i}.bias"] = (a, b), (b,)
        return shapes
    return {name: tuple(a.shape) for name, a in spec.init(0).items()}


@dataclasses.dataclass(frozen=True)
class ModelPartition:
    """A spec model cut into ``stages x chunks`` pieces of whole layers.

    Attributes:
        stages: pipeline stages ``S``.
        chunks: chunks per stage ``v``; piece ``k`` is local chunk ``k // S`` of stage ``k % S``.
        layers: each piece's layer range (GPT blocks, MLP layers).
        names: each piece's parameter names, in the model's order (the embeddings join the first
            piece, a GPT's ``ln_f`` and head the last).
        costs: each piece's parameter count (a tied embedding counted on both ends).
        shared: a parameter held by more than one piece -> those pieces (a tied GPT's
            ``tok_emb`` is used by the first piece's embedding and the last piece's head; their
            gradients must be summed).
    """

    stages: int
    chunks: int
    layers: tuple[range, ...]
    names: tuple[tuple[str, ...], ...]
    costs: tuple[int, ...]
    shared: dict[str, tuple[int, ...]]

    def piece(self, stage: int, chunk: int = 0) -> int:
        """The piece (virtual stage) index of ``stage``'s local ``chunk``."""
        return chunk * self.stages + stage

    def names_on(self, stage: int) -> tuple[str, ...]:
        """Every parameter name stage ``stage`` holds (all its chunks), each once."""
        seen: dict[str, None] = {}
        for chunk in range(self.chunks):
            seen.update(dict.fromkeys(self.names[self.piece(stage, chunk)]))
        return tuple(seen)


def partition_model(spec, stages: int, chunks: int = 1,
                    splits: Sequence[int] | None = None) -> ModelPartition:
    """``spec`` (``toolkit.GPT``, ``toolkit.MLP``, ``toolkit.CNN``) cut into pipeline pieces.

    Layers are the spec's numbered units (``blocks.i``, ``layers.i``, ``convs.i``); balanced by
    parameter count unless ``splits`` gives the first layer of every piece but the first.

    Example:
        >>> from toolkit import GPT
        >>> p = partition_model(GPT(vocab=256, context=16, width=32, layers=4, heads=2), 2)
        >>> [list(r) for r in p.layers], p.shared
        ([[0, 1], [2, 3]], {'tok_emb': (0, 1)})
    """
    from toolkit.parallel.shards import units_of

    shapes = _shapes_of(spec)
    units = list(units_of(shapes).values())
    sizes = {name: math.prod(shape) for name, shape in shapes.items()}
    tied = bool(getattr(spec, "tied", False))
    costs = [sum(sizes[n] for n in unit) for unit in units]
    if tied:  # the last layer's head multiplies by tok_emb: hold (and count) it there too
        costs[-1] += sizes["tok_emb"]
    ranges = partition_layers(costs, stages, chunks, splits)
    names = [tuple(n for i in r for n in units[i]) for r in ranges]
    shared = {}
    if tied and len(ranges) > 1:
        names[-1] = (*names[-1], "tok_emb")
        shared["tok_emb"] = (0, len(ranges) - 1)
    piece_costs = tuple(int(sum(costs[i] for i in r)) for r in ranges)
    return ModelPartition(stages, chunks, ranges, tuple(names), piece_costs, shared)


WITHIN_NODE = ("stages", "replicas")


@dataclasses.dataclass(frozen=True)
class PipelineGrid:
    """Where a rank sits in ``replicas`` data-parallel copies of a ``stages``-stage pipeline.

    Args:
        world_size: ranks (or devices: the JAX backends place their devices on the same grid,
            device ``i`` of the process-major order in place of rank ``i``).
        stages: pipeline stages ``S``.
        within_node: the axis on consecutive ranks, so within a node: ``"stages"`` (rank ``r``
            is stage ``r % S`` of replica ``r // S``) or ``"replicas"`` (stage ``r // D`` of
            replica ``r % D``).
        per_rank: indices that come in runs of this many, a rank's devices: a run holds
            ``per_rank`` consecutive replicas of one stage, and the runs sit on the grid as
            ranks do (so a process's devices hold one stage, as the Trainer's samples assume).

    Every position is plain arithmetic (``//``, ``%``, ``*``, ``+``), so a traced index works
    too (jax-pmap's ``lax.axis_index``).

    Example:
        >>> grid = PipelineGrid(world_size=4, stages=2)
        >>> [(grid.stage_of(r), grid.replica_of(r)) for r in range(4)]
        [(0, 0), (1, 0), (0, 1), (1, 1)]
        >>> PipelineGrid(4, 2, within_node="replicas").stage_ranks(0)
        (0, 1)
    """

    world_size: int
    stages: int
    within_node: str = "stages"
    per_rank: int = 1

    def __post_init__(self) -> None:
        _count("world size", self.world_size, "world size 4")
        _count("stages", self.stages, "stages=2")
        _count("per_rank", self.per_rank, "per_rank=1")
        check_within_node(self.within_node)
        if self.world_size % self.stages:
            raise ToolkitError(
                f"world size {self.world_size} is not a multiple of the {self.stages} pipeline "
                "stages", f"launch S x D ranks, e.g. {self.stages} or {2 * self.stages}, or use "
                "a number of stages that divides the world size")
        if self.world_size % (self.stages * self.per_rank):
            raise ToolkitError(
                f"{self.world_size} devices in runs of {self.per_rank} per rank do not give "
                f"each of the {self.stages} stages whole runs",
                f"use a number of ranks that is a multiple of {self.stages}")

    @property
    def replicas(self) -> int:
        return self.world_size // self.stages

    @property
    def _stages_inside(self) -> bool:
        return self.within_node == "stages"

    def stage_of(self, rank: int) -> int:
        if self._stages_inside:
            return rank // self.per_rank % self.stages
        return rank // self.replicas

    def replica_of(self, rank: int) -> int:
        if self._stages_inside:
            p = self.per_rank
            return rank // (p * self.stages) * p + rank % p
        return rank % self.replicas

    def rank(self, stage: int, replica: int) -> int:
        if self._stages_inside:
            p = self.per_rank
            return (replica // p * self.stages + stage) * p + replica % p
        return stage * self.replicas + replica

    def pipeline_ranks(self, replica: int) -> tuple[int, ...]:
        """The ranks of ``replica``'s stages, stage 0 first (they pass activations)."""
        return tuple(self.rank(s, replica) for s in range(self.stages))

    def stage_ranks(self, stage: int) -> tuple[int, ...]:
        """The ranks holding ``stage`` (they average its gradients), in increasing order."""
        return tuple(self.rank(stage, d) for d in range(self.replicas))

    def end_ranks(self) -> tuple[int, ...]:
        """The ranks of the first and the last stage, in increasing order: they sum the
        gradient of a parameter both hold (a GPT's tied ``tok_emb``; Megatron-LM's embedding
        group)."""
        last = self.stage_ranks(self.stages - 1) if self.stages > 1 else ()
        return tuple(sorted(self.stage_ranks(0) + last))

    def reduction_groups(self) -> tuple[tuple[int, ...], ...]:
        """The rank groups a step's gradient reduction runs in, leaving out single ranks and
        the whole world: each stage's replicas (when ``D > 1``) and the end stages' ranks (when
        ``S > 2``). Backends whose groups are fixed at start-up (Horovod's static process sets,
        registered at ``hvd.init``) create these.

        Example:
            >>> PipelineGrid(world_size=6, stages=3).reduction_groups()
            ((0, 3), (1, 4), (2, 5), (0, 2, 3, 5))
            >>> PipelineGrid(world_size=6, stages=3, within_node="replicas").reduction_groups()
            ((0, 1), (2, 3), (4, 5), (0, 1, 4, 5))
        """
        groups = [self.stage_ranks(s) for s in range(self.stages)] + [self.end_ranks()]
        out: list[tuple[int, ...]] = []
        for g in groups:
            if 1 < len(g) < self.world_size and g not in out:
                out.append(g)
        return tuple(out)


def tied_across_stages(names_by_stage: Sequence[Sequence[str]], layout: object = "the layout"
                       ) -> tuple[str, ...]:
    """The parameters held by more than one stage (``names_by_stage[s]``: stage ``s``'s
    names), in first-seen order; a ToolkitError naming each one held elsewhere than exactly
    the first and the last stage.

    The end stages sum such a parameter's gradients in a group set up before the model is
    known (Megatron-LM's embedding group, ``PipelineGrid.end_ranks``), so their copies stay
    equal; a parameter shared with a middle stage has no such group and would train apart.

    Example:
        >>> tied_across_stages([("emb", "h0"), ("h1",), ("emb", "out")])
        ('emb',)
    """
    stages = len(names_by_stage)
    held: dict[str, list[int]] = {}
    for s, names in enumerate(names_by_stage):
        for n in dict.fromkeys(names):
            held.setdefault(n, []).append(s)
    shared = {n: where for n, where in held.items() if len(where) > 1}
    apart = {n: where for n, where in shared.items() if where != [0, stages - 1]}
    if apart:
        which = "; ".join(f"{n} on stages {', '.join(map(str, where))}"
                          for n, where in apart.items())
        raise ToolkitError(
            f"{layout} would cut parameters shared by several layers apart: {which}",
            "only the first and the last stage may share a parameter (a head tied to the "
            "embedding, kept equal by summing their gradients); choose split points that keep "
            "the layers sharing it on one stage, or untie it")
    return tuple(shared)


def check_within_node(value: object) -> str:
    """``value`` when it names a pipeline axis to keep within a node, else a ToolkitError."""
    if value not in WITHIN_NODE:
        raise ToolkitError(
            f"within_node={value!r} is not a pipeline axis",
            "use 'stages' (a replica's stages on neighbouring ranks, inside a node: the "
            "default) or 'replicas' (a stage's replicas inside a node, stages across nodes)")
    return str(value)


def micro_batch_size(local_batch: int, micro_batches: int) -> int:
    """The size of each of ``micro_batches`` micro-batches of a ``local_batch``-sample batch.

    Example:
        >>> micro_batch_size(32, 8)
        4
    """
    local_batch = _count("local batch", local_batch, "a batch of 32")
    micro_batches = _count("micro_batches", micro_batches, "micro_batches=4")
    if local_batch % micro_batches:
        fits = ", ".join(str(m) for m in range(1, local_batch + 1) if local_batch % m == 0)
        raise ToolkitError(
            f"{micro_batches} micro-batches do not divide the local batch of {local_batch} "
            "samples", f"use a number of micro-batches that divides it ({fits}), or a local "
            f"batch that is a multiple of {micro_batches}")
    return local_batch // micro_batches
