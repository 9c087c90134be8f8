"""The host side of the JAX pipeline executors (jax-pjit's and jax-pmap's).

``PipelineExecutor``: checks, the staged state, the step's round loop with its
``toolkit.StageRecorder`` timing, evaluation and checkpoints; a subclass places arrays and wraps
``adapters._jax.programs.StagePrograms`` in its mechanism: the pipeline layout's strategy.

A native model's state (BatchNorm statistics) is held per device as each stage's flat state
vector (``state``), moved by the step's forwards and settled by the update (averaged over the
stage's replicas, or kept when the step is skipped: ``programs.py``); it is checkpointed under
data parallelism's names (``buffers/<collection>/<path>``), and a native model's step count as
``rng/step`` (its dropout keys derive from it), so a checkpoint moves between layouts.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, Protocol

import numpy as np

from adapters._backend import StrategyBase
from adapters._common import (
    check_build,
    check_recompute,
    check_spec_optimizer,
    loss_name,
    step_seed,
)
from adapters._jax.native_optax import StageOptimizer
from adapters._jax.precision import JaxPrecision
from adapters._jax.programs import LocalComputes, StagePrograms
from adapters._jax.rounds import RoundPlan
from adapters._jax.runtime import gloo_connect_line_silenced
from adapters._jax.stages import eval_sums, stage_model
from adapters._jax.strategy import JaxStrategy, LocalMean
from adapters._jax.update import is_native, make_optimizer
from toolkit import Pipeline, ToolkitError
from toolkit.contract import StepResult
from toolkit.errors import describe
from toolkit.models.specs import ModelSpec
from toolkit.parallel.pipeline.partition import micro_batch_size
from toolkit.parallel.pipeline.schedules import pipeline_schedule
from toolkit.parallel.pipeline.timeline import TIMELINE_ENV, StageRecorder, append_timeline
from toolkit.precision import PRECISIONS


class StagePlacement(Protocol):
    """What a JAX backend gives :class:`PipelineExecutor`: where the stages' arrays live
    (stacked over pmap's device axis, or sharded over a ``(stage, data)`` mesh) and the
    mechanism that moves them; the executor calls nothing else of its subclass."""

    def _setup_devices(self, devices: list[Any]) -> None:
        """Sets ``where``: the global index of each local device (in ``local_devices``' order;
        device ``i`` sits at ``grid.stage_of(i)``, ``grid.replica_of(i)``)."""

    def _collectives(self) -> Any:
        """The stage-axis collectives the compiled programs use (``ppermute`` shifts, psums)."""

    def _per_stage(self, host: np.ndarray) -> Any:
        """A host array with a leading stage axis, placed one row per stage."""

    def _per_device(self, host: np.ndarray) -> Any:
        """A host array with a leading stage axis, a copy of its stage's row on every device
        (placed as :meth:`_zeros` places: each device may then hold its own values)."""

    def _zeros(self, shape: tuple[int, ...]) -> Any:
        """Zeros of ``shape`` on every local device."""

    def _batch(self, local: np.ndarray) -> Any:
        """This process's local samples placed for the prepare program."""

    def _scalars(self, host: np.ndarray) -> Any:
        """The optimizer scalars (``JaxStrategy.optimizer_scalars``) placed for the update."""

    def _full(self, flat: Any) -> np.ndarray:
        """Every stage's flat vector on the host, ``(S, L)`` (of replica 0, for an array placed
        per device)."""

    def _compile(self, n: int, xi: np.ndarray, yi: np.ndarray) -> None:
        """Compiles for a local batch of ``n``: sets ``_prepare``, ``_exchange`` and
        ``_update``, and makes ``box`` and ``losses``."""


class PipelineExecutor(StrategyBase):
    """The host side of a JAX pipeline layout: the strategy of ``toolkit.Pipeline`` (``build``,
    ``train_step``, ``evaluate``, ``state_dict``, ``load_state_dict``, ``sharded_state``,
    ``memory_bytes``, ``position``).

    Args:
        runtime: the started JAX runtime. The executor keeps a ``JaxStrategy`` of its own
            (``host``) for the host side it shares with the other layouts: ``jax``, dtype,
            ``optimizer_scalars``, ``inputs``/``labels``, step counting and ``barrier``.
        layout: a ``toolkit.Pipeline``.
        samples: ``"replica"`` (the Trainer under a Pipeline layout: the sampler gives the
            ``S`` processes of a pipeline replica the same local batch, each local device its
            ``1/L`` slice) or ``"process"`` (every process its own samples, e.g. one process
            holding both stages: each device takes a ``1/L`` slice and a replica's batch is its
            ``S`` devices' slices gathered). Either way the loss is the global batch's mean.
        keep_steps: steps of timeline records kept (the latest).

    A subclass is a :class:`StagePlacement` (where the stages' arrays live and how they move);
    the computes are the executor's own (``adapters._jax.programs.LocalComputes``).
    """

    clips = True  # build takes clip_grad_norm
    skips = True  # build takes skip_nonfinite; its StepResult then says skipped
    precisions = PRECISIONS  # (StagePrograms' compute)
    plugin = JaxPrecision  # (adapters/_precision.py)
    recomputes = True  # activation_checkpointing: each piece's forward again in its backward
    position: tuple[int, int] = (0, 0)  # this process's (stage, replica), known at build

    @staticmethod
    def check_layout(layout: Pipeline) -> None:
        """Refused at ``build`` (the devices decide what fits)."""

    def __init__(self, runtime: Any, layout: Pipeline, precision: Any = None,
                 samples: str = "replica", keep_steps: int = 4):
        if samples not in ("replica", "process"):
            raise ToolkitError(f"samples={samples!r}", "use 'replica' or 'process'")
        if not isinstance(layout, Pipeline):
            raise ToolkitError(f"{describe(layout)} is not a toolkit.Pipeline",
                               "pass toolkit.Pipeline(stages=..., micro_batches=...)")
        super().__init__(runtime, layout, precision)  # (StrategyBase: runtime, env, layout)
        # the strategy it computes with shares its precision plugin (one loss scaler)
        self.host = JaxStrategy(runtime, layout, self.precision)
        self.keep_steps, self.samples = keep_steps, samples
        self.schedule = pipeline_schedule(layout.schedule, layout.stages, layout.micro_batches,
                                          layout.chunks)
        self.plan = RoundPlan(self.schedule)
        self.step_index = 0
        self.recorders: dict[int, StageRecorder] = {}

    def build(self, model: Any, optimizer: Any, loss: Any, *, seed: int = 0,
              accumulation_steps: int = 1, sync_batchnorm: bool = False,
              metrics: Any = None, clip_grad_norm: float | None = None,
              skip_nonfinite: bool = False, activation_checkpointing: bool | None = None) -> None:
        a, jax, name, S = self.host, self.host.jax, self.host.name, self.layout.stages
        check_build(accumulation_steps, sync_batchnorm)
        self.recompute = bool(check_recompute(name, model, activation_checkpointing))
        if not is_native(optimizer):  # (an optax transformation: StageOptimizer checks it)
            check_spec_optimizer(name, "pipeline", optimizer)
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        if len(devices) % S:
            raise ToolkitError(
                f"{name}: {len(devices)} devices ({a.env.world_size} processes x "
                f"{jax.local_device_count()} local) do not divide into {S} pipeline stages",
                f"launch a multiple of {S} devices in all, or use a number of stages that "
                f"divides {len(devices)}")
        if self.samples == "replica" and a.env.world_size % S:
            raise ToolkitError(
                f"{name}: {a.env.world_size} processes are not a multiple of the {S} pipeline "
                f"stages", f"launch a multiple of {S} processes (the sampler gives each "
                "pipeline replica of processes its samples)")
        self.staged = stage_model(model, self.layout, seed, a.dtype_name, name)
        self.seed, self.native = seed, not isinstance(model, ModelSpec)
        self.loss_name, self.loss_fn = loss_name(loss), loss
        # its labels, optimizer_scalars and update rule read them
        a.start_counting(loss, optimizer, clip_grad_norm, skip_nonfinite)
        self.metrics = dict(metrics or {})
        self.tx = make_optimizer(optimizer, name)
        per_rank = jax.local_device_count() if self.samples == "replica" else 1
        self.grid = self.layout.grid(len(devices), per_rank)  # (a process: a stage's replicas)
        self.D = self.grid.replicas
        self._setup_devices(devices)
        self._index_of = dict(zip(self.local_devices, self.where, strict=True))
        self._stage_of = {d: self.grid.stage_of(i) for d, i in self._index_of.items()}
        self._replica_of = {d: self.grid.replica_of(i) for d, i in self._index_of.items()}
        host = self.staged.flatten(self.staged.init, a.dtype_name)
        state = self.staged.flatten_state(self.staged.state_init, a.dtype_name)
        if a.env.world_size > 1:  # rank 0's initial parameters and state become everyone's
            from jax.experimental import multihost_utils

            with gloo_connect_line_silenced():  # (maybe the first cross-process collective)
                host, state = (np.asarray(t) for t in
                               multihost_utils.broadcast_one_to_all((host, state)))
        # a spec's slots, or the user's elementwise optax transformation on each stage's vector
        self.opt = StageOptimizer(name, self.layout, optimizer, self.tx, self.staged, model)
        self._set_state(host, self.opt.init(host), state)
        self.grads = self._zeros((self.staged.length,))
        self.ctrl = [[self._per_stage(w.ctrl) for w in r.waves] for r in self.plan.rounds]
        local = [(self.grid.stage_of(i), self.grid.replica_of(i)) for i in self.where]
        self.local_stages = sorted({s for s, _ in local})
        self.position = (local[0][0], local[0][1] // jax.local_device_count())
        self.recorders = {s: StageRecorder(s, min(d for t, d in local if t == s))
                          for s in self.local_stages}
        self._compiled_for = None

    def _set_state(self, params: np.ndarray, opt: Any, state: np.ndarray) -> None:
        self.params = self._per_stage(params)
        self.opt_state = self.host.jax.tree_util.tree_map(self._per_stage, opt)
        self.state = self._per_device(state)

    def _programs(self, n: int, x_shape, x_dtype) -> StagePrograms:
        """The bodies for a global batch of ``n`` rows (each process's ``n / P`` rows)."""
        jax, S, D, M = self.host.jax, self.layout.stages, self.D, self.layout.micro_batches
        gather = self.samples == "process"
        # "process": every process's samples differ, a replica gathers its S devices' shares;
        # "replica": a replica's S processes hold the same samples (n counts them S times).
        mb = micro_batch_size(n // D if gather else n // (S * D), M)
        progs = StagePrograms(jax, self.staged, self.loss_fn, self.tx, self._collectives(), M,
                              mb, 1.0 / n if gather else S / n, gather,
                              jax.ShapeDtypeStruct((mb,) + tuple(x_shape[1:]), x_dtype),
                              self.host.dtype, self.host.rule, self.precision,
                              self.recompute, D)
        self.local = LocalComputes(jax, progs)
        return progs

    # ------------------------------------------------------------------ training
    def train_step(self, x: np.ndarray, y: np.ndarray, lr: float | None) -> StepResult:
        """One step on this process's samples; returns the global batch's mean loss (the same
        on every process, so the Trainer's average over processes is that mean)."""
        a, jax = self.host, self.host.jax
        local = jax.local_device_count()
        if len(x) % local:
            raise ToolkitError(
                f"{a.name}: the local batch of {len(x)} samples does not split over {local} "
                "local devices", f"use a global batch divisible by all {jax.device_count()} "
                "devices")
        n = len(x) * a.env.world_size
        replica_batch = n // self.D // (1 if self.samples == "process" else self.layout.stages)
        if replica_batch % self.layout.micro_batches:
            micro_batch_size(replica_batch, self.layout.micro_batches)  # its error and hint
        xi, yi = a.inputs(x), a.labels(y)
        shapes = (xi.shape, xi.dtype, yi.shape, yi.dtype)
        fresh = self._compiled_for != shapes
        if fresh:
            self._compile(n, xi, yi)
            self._compiled_for = shapes
            self._like = {i: (t.shape, t.sharding, [sh.device for sh in t.addressable_shards])
                          for i, t in ((1, self.grads), (2, self.box), (3, self.losses),
                                       (6, self.state))}
        if not (fresh and a.env.world_size > 1):
            return self._step(xi, yi, lr, fresh)
        # The first step's collectives connect Gloo groups of their own (a stage's one
        # replica, say), and Gloo prints "[Gloo] Rank 0 is connected to 0 peer ranks" to the
        # C-level stdout as each connects: silenced until the step has run on the devices.
        with gloo_connect_line_silenced():
            result = self._step(xi, yi, lr, fresh)
            jax.block_until_ready((self.params, self.state, self.grads))
        return result

    def _step(self, xi: np.ndarray, yi: np.ndarray, lr: float | None, fresh: bool) -> StepResult:
        """The step of ``train_step`` (its inputs and labels checked and converted; ``fresh``:
        its programs were just compiled)."""
        a, jax = self.host, self.host.jax
        step, clock = self.step_index, time.time
        scale = self.precision.loss_scale  # (fp16: a power of two, 2 ** exp)
        exp = np.asarray([0 if scale is None else math.frexp(scale)[1] - 1], np.int32)
        # the step's seed (its dropout keys: programs.py), from (seed, step) as data
        # parallelism's, its uint32 bits carried in the int32 row; then the device's replica
        seed = np.asarray([step_seed(self.seed, a.steps, 0)], np.uint32).view(np.int32)
        tails = {d: np.concatenate([exp, seed, [self._replica_of[d]]]).astype(np.int32)
                 for d in self.local_devices}
        xs, ys = self._prepare[0](self._batch(xi)), self._prepare[1](self._batch(yi))
        # (the state's blocks: the step's old state, which each forward replaces on its device)
        blocks = self._blocks(self.params, self.grads, self.box, self.losses, xs, ys,
                              self.state)
        named = self._named_params()
        for device, b in blocks.items():
            b[0] = named[device]
        # The timeline starts when the parameters are ready, as in the Horovod executors, whose
        # updates end before their steps return: the previous update and its slicing count as
        # the update's time (the step's), not as the first forward's and, behind it, as the
        # other stages' wait. Nothing is lost: round 0 could not start before them anyway.
        jax.block_until_ready(list(named.values()))
        if fresh:  # every local (action, device) program, then the processes meet
            for rnd in self.plan.rounds:
                for device, b in blocks.items():
                    branch = int(rnd.ctrl[self._stage_of[device]][0])
                    if branch and (branch, device) not in self.local.cache:
                        self.local.compile(branch, device, b)
            a.barrier()
        for waves, rnd in zip(self.ctrl, self.plan.rounds, strict=True):
            start = clock()
            ran = self.local.run(
                lambda d, r=rnd: np.concatenate([r.ctrl[self._stage_of[d]], tails[d]]), blocks)
            if waves:
                # Queued at once, the first wave starts on the devices as the computes end,
                # not after a trip through the host. The computes have ended when their
                # gradients (which no wave takes) are ready; the wave starts then.
                self.box = self._joined(blocks, 2)
                wave = rnd.waves[0]
                self.box = self._exchange[(wave.forward, wave.backward)](self.box, waves[0])
            for device in ran:
                blocks[device][1].block_until_ready()
            end = clock()
            for s in self.local_stages:
                if ran and rnd.compute[s] is not None:
                    self.recorders[s].add(rnd.compute[s], start, end, step)
            for i, (wctrl, wave) in enumerate(zip(waves, rnd.waves, strict=True)):
                start = end
                if i:
                    start = clock()
                    self.box = self._exchange[(wave.forward, wave.backward)](self.box, wctrl)
                self.box.block_until_ready()
                end = clock()
                for s in self.local_stages:
                    for act in wave.actions[s]:
                        self.recorders[s].add(act, start, end, step)
            if waves:
                for shard in self.box.addressable_shards:
                    blocks[shard.device][2] = shard.data
        self.grads, self.box, self.losses, moved = (self._joined(blocks, i)
                                                    for i in (1, 2, 3, 6))
        # This step's by-name parameters go before the next step's are sliced (behind the
        # update), so a stage never holds two such copies.
        for block in blocks.values():
            block[0] = None
        del named
        self._sliced = None
        scalars = self._scalars(a.optimizer_scalars(lr))
        a.count_step()
        self.params, self.opt_state, self.grads, loss, norm, self.state = self._update(
            self.params, self.opt_state, self.grads, self.losses, scalars, self.state, moved)
        del moved
        self._named_params()  # the next step's, queued behind the update (see there)
        self.step_index += 1
        folder = os.environ.get(TIMELINE_ENV)
        for s, rec in self.recorders.items():
            if folder:  # TOOLKIT_PIPELINE_TIMELINE=DIR: python -m toolkit.pipeline_timeline DIR
                append_timeline([r for r in rec.records if r["step"] == step], folder, s,
                                rec.replica)
            rec.records = [r for r in rec.records if r["step"] > step - self.keep_steps]
        return self.host.rule.result(LocalMean([loss.addressable_data(0)]),
                                     LocalMean([norm.addressable_data(0)]))

    def _named_params(self) -> dict:
        """Local device -> its stage's parameters by name, sliced out of ``self.params``' flat
        block: a copy, bound by memory bandwidth (about 32 ms for the 67 MB stage of
        ``benchmarks/pipeline_bubble.py`` on one core; a numpy copy of it takes 16-18 ms).

        ``train_step`` queues the slice right behind the update, so it starts as the update ends,
        while the host returns to the Trainer (in the bubble benchmark the next step still
        waits for most of it: the copy is the update's cost, now counted there). The cache holds
        for as long as ``self.params`` is the same array: a restore or any other assignment
        slices afresh."""
        cached = getattr(self, "_sliced", None)
        if cached is None or cached[0] is not self.params:
            named = {shard.device: self.local.params(self._stage_of[shard.device], shard.data)
                     for shard in self.params.addressable_shards}
            self._sliced = cached = (self.params, named)
        return cached[1]

    def _blocks(self, *arrays) -> dict:
        """Local device -> its block of each of ``arrays``."""
        out = {device: [] for device in self.local_devices}
        for array in arrays:
            for shard in array.addressable_shards:
                out[shard.device].append(shard.data)
        return out

    def _joined(self, blocks: dict, i: int):
        """The global array of the grads (1), box (2), losses (3) or state (6) from the local
        blocks."""
        shape, sharding, devices = self._like[i]
        return self.host.jax.make_array_from_single_device_arrays(
            shape, sharding, [blocks[d][i] for d in devices])

    @property
    def data_split(self) -> tuple[int, int]:
        """A replica's batch in contiguous parts (local devices x micro-batches)."""
        return (self.env.world_size // self.layout.stages,
                self.host.jax.local_device_count() * self.layout.micro_batches)

    @property
    def part_weight(self) -> float:
        """Each part's loss is its share of the global batch's mean (replicas then sum)."""
        ranks, parts = self.data_split
        return 1.0 / (ranks * parts)

    def pipeline_position(self) -> tuple[int, int]:
        """This process's ``(stage, replica)``: its first device's stage, and which of the
        stage's processes it is (``toolkit.PipelineGrid``'s position with one device each)."""
        return self.position

    def timeline(self) -> list[dict]:
        """This process's recorded actions (``toolkit.StageRecorder`` records, every local
        stage), of the latest ``keep_steps`` steps."""
        return [r for rec in self.recorders.values() for r in rec.records]

    # ------------------------------------------------------------------ evaluation, state
    def _named(self, flat) -> dict[str, np.ndarray]:
        return self.staged.unflatten(self._gathered(flat))

    def _named_state(self) -> dict[str, np.ndarray]:
        """The model state by name (replica 0's: after a step every replica's is the same)."""
        return self.staged.unflatten_state(self._gathered(self.state))

    def _gathered(self, flat) -> np.ndarray:
        """``_full(flat)``; its gather may connect a Gloo group of its own (a replica's stages,
        under jax-pjit), whose connect line is silenced as the first step's (``train_step``)."""
        if self.host.env.world_size == 1:
            return self._full(flat)
        with gloo_connect_line_silenced():
            return self._full(flat)

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
        """Local sums over ``x`` (the whole model on this process's first device)."""
        params = self._named(self.params)
        if not hasattr(self, "_jeval"):
            self._jeval = self.host.jax.jit(eval_sums(self.staged, self.loss_fn, self.loss_name,
                                                   self.metrics, self.host.precision.compute))
        sums = self._jeval(params, self._named_state(), self.host.inputs(x),
                           self.host.labels(y))
        return {**{k: float(v) for k, v in sums.items()}, "count": float(len(x))}

    def state_dict(self) -> dict[str, np.ndarray]:
        """Full tensors under the neutral names, on every process."""
        out = {f"params/{n}": v for n, v in self._named(self.params).items()}
        out.update(self.opt.named(self.opt_state, self._gathered))
        out.update({f"buffers/{n}": v for n, v in self._named_state().items()})
        return {**out, **self.host.rule.counters(), **self._replicated()}

    def _replicated(self) -> dict[str, np.ndarray]:
        """A native model's step count, as data parallelism saves it (``rng/step``: the next
        step's dropout keys derive from it)."""
        return {"rng/step": np.asarray(self.host.steps, np.int64)} if self.native else {}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        dtype, names = self.host.dtype_name, self.staged.names()
        kept = self.staged.state_names_all()
        missing = [f"params/{n}" for n in names if f"params/{n}" not in state] + [
            f"buffers/{n}" for n in kept if f"buffers/{n}" not in state]
        if missing:
            raise ToolkitError(f"the state lacks {missing[:3]} (of {len(missing)})",
                               "load a checkpoint of the same model")
        params = self.staged.flatten({n: state[f"params/{n}"] for n in names}, dtype)
        model_state = self.staged.flatten_state({n: state[f"buffers/{n}"] for n in kept}, dtype)
        self._set_state(params, self.opt.load(state, dtype, self.opt_state), model_state)
        self.host.rule.load(state)
        if self.native and "rng/step" in state:
            self.host.steps = int(state["rng/step"])

    def _replica0_rows(self, arr) -> dict[int, np.ndarray]:
        """Stage -> its flat vector, for the stages whose replica 0 is a local device."""
        rows = {}
        for shard in arr.addressable_shards:
            i = self._index_of[shard.device]
            if self.grid.replica_of(i) == 0:
                rows[self.grid.stage_of(i)] = np.asarray(shard.data).reshape(-1)
        return rows

    def sharded_state(self):
        """``(replicated, pieces)`` for a checkpoint: replica 0 of each stage gives each of its
        parameters (and optimizer slots, and model state) whole as one flat piece, a shared one
        only from its first holder; every other process gives an empty piece of every name."""
        replicated, stacked = self.opt.stores(self.opt_state)
        replicated.update({**self.host.rule.counters(), **self._replicated()})
        pieces = {}
        for key, arr, names, tables in [
                (lambda n: f"params/{n}", self.params, None, self.staged.offsets),
                *((k, a, None, self.staged.offsets) for k, a in stacked),
                (lambda n: f"buffers/{n}", self.state, self.staged.state_names_all(),
                 self.staged.state_offsets)]:
            mine = self._replica0_rows(arr)
            for name in self.staged.names() if names is None else names:
                s = self.staged.owner_stage(name)
                off, shape = tables[s][name]
                piece = (mine[s][off:off + int(np.prod(shape))].copy() if s in mine
                         else np.zeros(0, self.host.dtype_name))
                pieces[key(name)] = (piece, 0, shape)
        return replicated, pieces

    def memory_bytes(self) -> dict[str, int]:
        """Bytes on this process's devices between steps, from the arrays' own shards."""
        def held(*arrays):
            return int(sum(s.data.nbytes for a in arrays for s in a.addressable_shards))

        # params: the flat vectors and the by-name copy queued for the next step (_named_params)
        sliced = getattr(self, "_sliced", None)
        copies = sum(a.nbytes for named in sliced[1].values() for a in named.values()) if (
            sliced is not None and sliced[0] is self.params) else 0
        out = {"params": held(self.params) + copies, "grads": held(self.grads),
               "optimizer": held(*self.host.jax.tree_util.tree_leaves(self.opt_state))}
        if hasattr(self, "box"):  # and at most, during a step, what forwards keep for backwards
            out.update(activations=held(self.box), kept_for_backward=self.local.peak_kept)
        return out

    def sync_state(self) -> None:
        """Nothing to synchronise: each step's update leaves a stage's replicas the same model
        state (averaged over them, as jax-pmap's data parallelism averages it)."""
