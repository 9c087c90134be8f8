"""What the Horovod backends' pipeline executors share, framework-free (numpy only).

``horovod-torch`` (``horovod_torch/pipeline.py``) and ``horovod-tf`` (``_tf_pipeline.py``) run a
``toolkit.Pipeline`` the same way; this base class holds everything but the tensors' arithmetic:

- the rank grid (the layout's ``toolkit.PipelineGrid``: which rank holds which stage of which
  replica, as ``Pipeline.within_node`` places them),
  the schedule (``toolkit.pipeline_schedule``) regrouped into lockstep rounds
  (``toolkit.lockstep_rounds``), and the loop over them: each round every rank runs at most one
  forward or backward (the subclass's ``_compute``); the round's messages move in one named
  ``hvd.alltoall`` over the world (``adapters/_horovod/rounds.py``: asynchronous, with receives
  joined ahead, and why that cannot deadlock);
- the gradient reduction in Horovod process sets (registered at ``hvd.init`` by
  ``init_horovod``), on the device with the framework's grouped allreduce (one fused
  collective per set): after the rounds, the stage's replica set averages its gradients, and a
  tied parameter (a GPT's ``tok_emb`` on the first and the last stage) is summed in the end
  stages' set (Megatron-LM's embedding group); and the whole model's sum of squared gradients
  for the family's one update path (``update.py`` of each family), which the subclass calls;
- the step's loss: the last stage's, gathered so every rank of a replica returns it;
- evaluation: every rank's ``(x, y)`` goes to its replica's first stage (inputs) and last stage
  (labels), and the activations through the pieces;
- timelines (``toolkit.StageRecorder``; ``TOOLKIT_PIPELINE_TIMELINE=DIR`` appends each step's
  records to ``DIR/stage<S>-replica<D>.jsonl``);
- the state of the full model under neutral names (``state_dict`` gathers every tensor from
  its owner, replica 0 of the first stage holding it; ``sharded_state`` gives the checkpoint
  store each tensor whole from its owner and an empty piece from every other rank).

A subclass is a :class:`StageCompute`: the framework's part, written out below.
"""

from __future__ import annotations

import os
import time
from typing import Any, Protocol

import numpy as np

from adapters._backend import StrategyBase
from adapters._horovod.rounds import RoundMessages, unpack
from adapters._update import UpdateRule
from toolkit import ToolkitError
from toolkit.errors import describe
from toolkit.parallel.layouts import Pipeline
from toolkit.parallel.pipeline.partition import PipelineGrid, tied_across_stages
from toolkit.parallel.pipeline.schedules import pipeline_schedule
from toolkit.parallel.pipeline.simulation import lockstep_rounds
from toolkit.parallel.pipeline.timeline import TIMELINE_ENV, StageRecorder, append_timeline


def check_pipeline(layout: Any, world_size: int) -> PipelineGrid:
    """The rank grid of ``layout`` on ``world_size`` ranks, or a ToolkitError."""
    if not isinstance(layout, Pipeline):
        raise ToolkitError(f"{describe(layout)} is not a toolkit.Pipeline", "e.g. Pipeline(2, 4)")
    if layout.schedule == "interleaved-1f1b" and layout.stages == 1 and layout.chunks > 1:
        raise ToolkitError("interleaved-1f1b with 1 stage has no neighbour to interleave with",
                           "use 2 or more stages, or chunks=1")
    return layout.grid(world_size)


class StageCompute(Protocol):
    """What a framework gives :class:`HvdPipeline` (horovod-torch's and horovod-tf's pipeline
    strategies are both): its Horovod module, its stage's cut model and the hooks below; the
    base class calls nothing else of its subclass. A ``_compute`` that hands a backward's
    gradients to ``_defer`` also gives ``_sum(gradients)`` (horovod-tf's does)."""

    hvd: Any  # horovod.torch or horovod.tensorflow
    metric_names: tuple[str, ...]  # the user's metrics, in order (evaluation sums)
    cut: Any  # the stage's cut model: names_by_stage, shapes, buffers, buffer_specs
    slots: tuple[str, ...]  # the optimizer's slot names (checkpoint catalogue)

    def _alltoall_start(self, buf: np.ndarray, splits: list[int], name: str) -> Any:
        """Starts a round's named alltoall (or runs it: see ``RoundMessages._alltoall``)."""

    def _alltoall_wait(self, started: Any) -> tuple[np.ndarray, list[int]]:
        """The received bytes and per-rank sizes of a started alltoall."""

    def _allgather(self, flat: np.ndarray, name: str) -> np.ndarray: ...

    def _grouped_sum(self, tensors: list, process_set: Any, name: str) -> list:
        """Each tensor summed over ``process_set`` (a stage's replicas, the tied parameter's
        stages, or the world), on the device, in one grouped Horovod allreduce."""

    def _squares(self, tensors: list) -> Any:
        """The sum of the squares of every element of ``tensors`` (a scalar tensor; zero
        without tensors)."""

    def _host(self, tensor: Any) -> np.ndarray:
        """A framework tensor as numpy (a view where the framework allows)."""

    def _activation(self, array: np.ndarray, grad: bool) -> Any:
        """A received message as a tensor of its own (requiring its gradient if ``grad``)."""

    def _compute(self, action: Any) -> None:
        """Runs one forward or backward (``toolkit.Action``) of this rank's stage."""

    def _local(self) -> dict[str, np.ndarray]:
        """This rank's parameters and slots under their neutral checkpoint keys."""

    def _replicated(self) -> dict[str, np.ndarray]:
        """The state every rank holds alike (step counters)."""

    def _set_buffer(self, buffer: Any, array: np.ndarray) -> None:
        """Writes a loaded buffer (BatchNorm statistics) into the model."""

    part: Any  # the stage's data-parallel part (``stage_state.py``): its ``pieces(catalogue)``


class HvdPipeline(RoundMessages, StrategyBase):
    """The framework-free part of a Horovod pipeline executor (see the module's docstring); a
    subclass is a :class:`StageCompute`."""

    backend = "horovod"  # the backend's name, for errors
    metric_names: tuple[str, ...] = ()  # the build's metrics (their sums on idle ranks: 0)
    clips = True  # build takes clip_grad_norm (then the StepResult has grad_norm)
    skips = True  # build takes skip_nonfinite (then the StepResult says skipped)
    rule = UpdateRule()  # the build's (the subclass sets it)

    def __init__(self, runtime, layout: Pipeline, precision: Any = None):
        """``runtime``: the started Horovod runtime (``env``, ``dtype_name``, ``barrier``,
        ``process_sets`` registered at ``hvd.init``)."""
        super().__init__(runtime, layout, precision)  # (StrategyBase: runtime, env, layout)
        env = runtime.env
        # the pipeline on its (stage, replica) grid: a composition's data-parallel ranks are
        # its replicas (ZeRO shards them: the subclass's part)
        self.pipe = layout.dims.staged()
        self.grid = check_pipeline(self.pipe, env.world_size)
        if layout.dims.zero and self.grid.replicas == 1 and env.world_size > 1:
            raise ToolkitError(
                f"layout {layout.name} shards each stage over its replicas, but "
                f"{env.world_size} ranks give each of the {self.grid.stages} stages one",
                f"launch a multiple of {2 * self.grid.stages} ranks, or drop sharded:"
                f"{layout.dims.zero}")
        self.stage = self.grid.stage_of(env.rank)
        self.replica = self.grid.replica_of(env.rank)
        pipe = self.pipe
        self.schedule = pipeline_schedule(pipe.schedule, pipe.stages, pipe.micro_batches,
                                          pipe.chunks)
        self.rounds = lockstep_rounds(self.schedule)
        self._plan_rounds()
        self.timeline_dir = os.environ.get(TIMELINE_ENV) or None
        self.peak_activations = 0  # most micro-batches whose forward graph was held at once
        self.exchange_seconds: list[float] = []  # the last step's round alltoalls, in order

    @property
    def position(self) -> tuple[int, int]:
        """This rank's (stage, replica)."""
        return self.stage, self.replica

    @property
    def data_split(self) -> tuple[int, int]:
        """A replica's share of the global batch, each micro-batch's gradient computed apart
        (in its own rounded arithmetic under mixed precision) and summed in float32."""
        return self.grid.replicas, self.pipe.micro_batches

    @property
    def part_weight(self) -> float:
        """Each micro-batch's mean loss divided by ``M`` before its backward (the local
        batch's mean, as with accumulation steps)."""
        return 1.0 / self.pipe.micro_batches

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(self.runtime.dtype_name)

    def _start(self, mine: list[str]) -> None:
        """After build: the reduction plan for this stage's parameters ``mine`` (in order), and
        the timeline's common origin (a barrier)."""
        grid, names = self.grid, self.cut.names_by_stage
        self.mine = list(mine)
        tied = set(tied_across_stages(names, self.pipe))  # (refused unless end stages)
        self.tied = sorted(n for n in self.mine if n in tied)  # (both ends in one order)
        self.rest = [n for n in self.mine if n not in tied]
        # Horovod process sets: this stage's replicas, and the end stages for a tied parameter
        self.stage_set = (self._process_set(grid.stage_ranks(self.stage))
                          if grid.replicas > 1 else None)
        self.ends_set = self._process_set(grid.end_ranks()) if self.tied else None
        self.reduce = self.stage_set is not None or self.ends_set is not None
        self.steps = 0
        self.recorder = StageRecorder(self.stage, self.replica)
        self.runtime.barrier()
        self.recorder.origin = time.time()

    def _process_set(self, ranks: tuple[int, ...]) -> Any:
        """The Horovod process set of ``ranks`` (registered by ``init_horovod``)."""
        found = self.runtime.process_set(ranks)
        if found is None:
            raise ToolkitError(
                f"{self.layout} averages gradients in the Horovod process set of ranks "
                f"{list(ranks)}, which was not registered at hvd.init",
                "pass the layout to setup(env, layout) (toolkit.Trainer does), so that setup "
                "registers the layout's process sets")
        return found

    # ------------------------------------------------------------------------------ steps
    def _is_last(self, chunk: int) -> bool:
        """Whether this stage's local ``chunk`` is the model's last piece."""
        return chunk * self.grid.stages + self.stage == self.grid.stages * self.pipe.chunks - 1

    def _run_rounds(self) -> float:
        """The schedule's rounds (fresh in/outboxes); returns the replica's loss. The stage's
        gradients are then the subclass's: :meth:`_reduced`, and its family's update."""
        self.inputs, self.outputs, self.loss, self.message_bytes = {}, {}, 0.0, 0
        self.deferred: tuple | None = None  # see _defer
        first = len(self.recorder.records)
        self._start_rounds()
        for index, rnd in enumerate(self.rounds):
            action = rnd.compute[self.stage]
            if action is not None:
                self._await(action)
                with self.recorder.action(action, self.steps):
                    self._compute(action)
            self._after_compute(index)
        self._await()
        losses = self._allgather(np.asarray([self.loss], np.float64), "pipeline.loss")
        if self.timeline_dir:
            append_timeline(self.recorder.records[first:], self.timeline_dir, self.stage,
                            self.replica)
        del self.recorder.records[:first]  # keep the latest step's records only
        return float(losses[self.grid.rank(self.grid.stages - 1, self.replica)])

    # ------------------------------------------------------------------------------ deferred sums
    def _defer(self, action: Any, gradients: Any) -> None:
        """Holds backward ``action``'s parameter gradients, to be added to the step's sums (the
        subclass's ``_sum(gradients)``) when the stage next waits for a message, or before its
        next backward (so at most one backward's are held: for that while, one more
        gradient-sized set of tensors than summing in place), or at the end of the rounds.

        A backward's message to the previous stage then goes out before its gradient sums are
        made, and the sums fill the wait for the next message instead of delaying it: in 1F1B's
        steady state every stage waits for a neighbour's message once per micro-batch, and at
        S = 2 the whole message time is on the critical path. The timeline records the sums as
        a second part of the backward (an action in parts: ``toolkit.parallel.pipeline.timeline``).

        horovod-tf uses it; horovod-torch does not: its autograd adds each parameter's gradient
        to ``.grad`` in place during the backward, and deferring that
        (``torch.autograd.grad``, then ``add_``) makes the adds slower and the steps longer
        (docs/benchmarks.md, the executors' choices)."""
        self.deferred = (action, gradients)

    def _await(self, action: Any = None) -> None:
        if self.deferred is not None and (action is None or action.kind == "B"
                                          or self._wanted(action)):
            done, gradients = self.deferred
            self.deferred = None
            start = time.time()
            self._sum(gradients)
            del gradients  # freed here, within the record (a large free takes a while)
            self.recorder.add(done, start, time.time(), self.steps)
        super()._await(action)

    def _reduced(self, grads: dict[str, Any]) -> dict[str, Any]:
        """This stage's summed gradients (framework tensors on the rank's device, by name),
        each averaged over the replicas of its stage, a tied parameter's summed over the two
        end stages holding it as well (Megatron-LM's embedding group): one grouped allreduce
        per process set, on the device. Every member gets the same bits, so replicas and both
        copies of a tied parameter stay equal."""
        if not self.reduce:
            return grads
        out = dict(grads)
        for names, process_set, tag in ((self.tied, self.ends_set, "ends"),
                                        (self.rest, self.stage_set, "stage")):
            if names and process_set is not None:
                summed = self._grouped_sum([grads[n] for n in names], process_set,
                                           f"pipeline.grads.{tag}")
                out.update(zip(names, summed, strict=True))
        replicas = self.grid.replicas
        return out if replicas == 1 else {n: out[n] / replicas for n in self.mine}

    def _sum_of_squares(self, grads: dict[str, Any]) -> Any:
        """The whole model's sum of squared gradients (the same on every rank), given this
        stage's reduced ``grads``: every stage's squares (a tied parameter's on the first stage
        only) added over the world in one allreduce, each replica's stages counted once. The
        family's update takes its root as the norm."""
        counted = [grads[n] for n in self.mine if self.stage == 0 or n not in self.tied]
        total, = self._grouped_sum([self._squares(counted)], self.hvd.global_process_set,
                                   "pipeline.grad_norm")
        return total / self.grid.replicas

    # ------------------------------------------------------------------------------ evaluation
    def _eval_data(self, x: np.ndarray, y: np.ndarray):
        """Every replica rank's ``(x, y)``: the inputs concatenated on the first stage, the
        labels on the last (``None`` elsewhere)."""
        grid = self.grid
        f64 = np.float64
        first, last = grid.rank(0, self.replica), grid.rank(grid.stages - 1, self.replica)
        outgoing = {first: [x]}
        outgoing.setdefault(last, []).append(y)
        got = self._exchange(outgoing, f64, "pipeline.eval_data")
        xs, ys = [], []
        for src in grid.pipeline_ranks(self.replica):
            offset = 0
            if self.env.rank == first:
                part, offset = unpack(got[src], offset)
                xs.append(part)
            if self.env.rank == last:
                ys.append(unpack(got[src], offset)[0])
        return (np.concatenate(xs).astype(x.dtype) if xs else None,
                np.concatenate(ys).astype(y.dtype) if ys else None)

    def _through(self, h: Any, run) -> Any:
        """``h`` (the first stage's inputs) through every piece: ``run(chunk, h)`` on this
        stage's pieces, the activations handed on between stages; the last stage's output."""
        grid, S = self.grid, self.grid.stages
        V = S * self.pipe.chunks
        for k in range(V):
            if k % S == self.stage:
                h = run(k // S, h)
            if k < V - 1 and S > 1:  # hand the activations on to piece k+1's stage
                src, dst = k % S, (k + 1) % S
                out = {grid.rank(dst, self.replica): [self._host(h)]} if self.stage == src else {}
                got = self._exchange(out, self.np_dtype, "pipeline.eval_through")
                if self.stage == dst:
                    h = self._activation(unpack(got[grid.rank(src, self.replica)], 0,
                                                self._narrow)[0],
                                         grad=False)
        return h

    def _is_eval_output(self) -> bool:
        return self.env.rank == self.grid.rank(self.grid.stages - 1, self.replica)

    def _empty_sums(self) -> dict[str, float]:
        return {"loss_sum": 0.0, "count": 0.0, "correct": 0.0,
                **dict.fromkeys(self.metric_names, 0.0)}

    # ------------------------------------------------------------------------------ state
    def _catalogue(self) -> list[tuple[str, tuple[int, ...], np.dtype, int]]:
        """Every tensor of the full model's state: (key, shape, dtype, owner rank)."""
        grid, names = self.grid, self.cut.names_by_stage
        dtype = self.np_dtype
        out = []
        for n, shape in self.cut.shapes.items():
            owner = grid.rank(min(s for s in range(grid.stages) if n in names[s]), 0)
            out.append((f"params/{n}", shape, dtype, owner))
            out += [(f"opt/{slot}/{n}", shape, dtype, owner) for slot in self.slots]
        for n, (stage, shape, buf_dtype) in self.cut.buffer_specs.items():
            out.append((f"buffers/{n}", shape, buf_dtype, grid.rank(stage, 0)))
        return out

    def state_dict(self) -> dict[str, np.ndarray]:
        """The whole model and optimizer state, on every rank (a collective: one allgather
        of a float64 buffer, lossless for float32, float64 and integer counters)."""
        rank = self.env.rank
        catalogue, local = self._catalogue(), self._local()
        mine = [local[key].reshape(-1).astype(np.float64)
                for key, _, _, owner in catalogue if owner == rank]
        everything = self._allgather(np.concatenate(mine) if mine else np.zeros(0),
                                     "pipeline.state")
        out, offset = {}, 0
        for owner in range(self.env.world_size):  # allgather concatenates in rank order
            for key, shape, dtype, who in catalogue:
                if who == owner:
                    size = int(np.prod(shape))
                    out[key] = everything[offset:offset + size].reshape(shape).astype(dtype)
                    offset += size
        return {**out, **self._replicated()}

    def sharded_state(self):
        """``(replicated, pieces)`` for ``CheckpointStore.save(..., shards=pieces)``: the
        stage's part gives them (``part.pieces``): each tensor whole from its owner and an
        empty piece from every other rank (:meth:`_owned_pieces`), or, where the stage shards
        it (pipeline x ZeRO), each replica's piece of its shard, concatenated in rank order."""
        return self._replicated(), self.part.pieces(self._catalogue())

    def _owned_pieces(self, local: dict[str, np.ndarray], catalogue: list,
                      shards: dict[str, tuple] | None = None) -> dict:
        """Each key of ``local`` whole from its owner; an empty piece of every key elsewhere.
        ``shards``: this rank's pieces of the tensors its stage shards (pipeline x ZeRO),
        written where its stage is the owner's (a tied unit: by the first stage's replicas)."""
        rank = self.env.rank
        out = {key: (local[key].reshape(-1) if owner == rank and key in local
                     else np.zeros(0, dtype), 0, shape)
               for key, shape, dtype, owner in catalogue}
        for key, _, _, owner in catalogue if shards else ():
            if key in shards and self.grid.stage_of(owner) == self.stage:
                out[key] = shards[key]
        return out

    def sync_state(self) -> None:
        """Replica 0's buffers (BatchNorm statistics) of each stage become its replicas'."""
        if self.grid.replicas == 1 or not self.cut.buffer_specs:
            return
        grid = self.grid
        mine = [self._host(b) for _, b in self.cut.buffers]
        outgoing = {}
        if self.replica == 0 and mine:
            outgoing = {r: mine for r in grid.stage_ranks(self.stage)[1:]}
        got = self._exchange(outgoing, np.float64, "pipeline.buffers")
        if self.replica and mine:
            offset = 0
            for _, b in self.cut.buffers:
                part, offset = unpack(got[grid.rank(self.stage, 0)], offset)
                self._set_buffer(b, part)

