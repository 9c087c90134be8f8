"""jax-pmap's pipeline layout (``toolkit.Pipeline``): ``jax.pmap`` over every process's devices
on one axis, stages exchanging activations and their gradients with ``lax.ppermute`` between
explicit device indices.

Ranks. Device ``i`` of the pmap axis (every device, process-major: a process's devices are
consecutive indices, checked at build) sits where the layout's ``toolkit.PipelineGrid`` over
the devices puts it (``executor.grid``), as in jax-pjit's ``(stage, data)`` mesh, so a run
moves between the two backends unchanged.
Every array has the local devices on its leading axis: a device holds its stage's flat
parameter vector (a copy per replica), its own gradient, box, losses and model state.

Collectives (``DeviceAxisCollectives``, the mechanism of
``adapters._jax.programs.StagePrograms``, whose bodies jax-pjit runs under
``shard_map``): ``ppermute`` with the pairs ``(grid.rank(a, d), grid.rank(b, d))`` for every
replica ``d``; the sum over a stage's ``D`` replicas and the tied embedding's sum over a
replica's holder stages are ``psum`` with ``axis_index_groups`` (the groups
``grid.stage_ranks(s)`` and ``grid.pipeline_ranks(d)``), and the prepare step's gather of a
replica's inputs is ``all_gather`` with the latter groups. Grouped collectives work across
processes on CPU with XLA's Gloo collectives on JAX 0.10.2 (verified here under ``horovodrun
--gloo``: 2 processes x 1 and x 2 devices, 4 processes x 1, against the sums by hand), so no
padded one-hot ``(S, L)`` psum over every device is needed: each gradient element crosses
only its own group.

Compilation. A pmapped program cannot be compiled ahead for the local shapes of a multi-process
run (``lower`` takes global ones), so each program's first call is preceded by a barrier: the
processes start compiling together and none waits 30 s in a collective while another still
compiles (jax issue 40831).
"""

from __future__ import annotations

from functools import partial

import numpy as np

from adapters._jax.pipeline import PipelineExecutor
from toolkit import ToolkitError

AXIS = "pipe"


class DeviceAxisCollectives:
    """The mechanism of ``StagePrograms`` on pmap's one device axis (see the module
    docstring)."""

    def __init__(self, lax, grid):
        self.lax, self.grid = lax, grid  # (a toolkit.PipelineGrid over the pmap axis)
        self.of_stage = [list(grid.stage_ranks(s)) for s in range(grid.stages)]
        self.of_replica = [list(grid.pipeline_ranks(d)) for d in range(grid.replicas)]

    def stage(self):
        return self.grid.stage_of(self.lax.axis_index(AXIS))

    def replica_sum(self, x):
        return self.lax.psum(x, AXIS, axis_index_groups=self.of_stage)

    def holder_sum(self, x):
        return self.lax.psum(x, AXIS, axis_index_groups=self.of_replica)

    def total(self, x):
        return self.lax.psum(x, AXIS)

    def shift(self, x, pairs):
        rank = self.grid.rank
        return self.lax.ppermute(x, AXIS, [(rank(a, d), rank(b, d)) for a, b in pairs
                                           for d in range(self.grid.replicas)])

    def gather_replica(self, x):
        return self.lax.all_gather(x, AXIS, axis_index_groups=self.of_replica, axis=0,
                                   tiled=True)


class _FirstCallBarrier:
    """``fn``, with a barrier before its first call (see the module docstring)."""

    def __init__(self, fn, barrier):
        self.fn, self.barrier, self.met = fn, barrier, False

    def __call__(self, *args):
        if not self.met:
            self.barrier()
            self.met = True
        return self.fn(*args)


class PmapPipeline(PipelineExecutor):
    """The pipeline layout of a ``JaxPmapAdapter`` (see ``PipelineExecutor`` for the
    arguments)."""

    def _setup_devices(self, devices) -> None:
        jax, lax = self.host.jax, self.host.jax.lax
        index = jax.pmap(lambda _: lax.axis_index(AXIS), axis_name=AXIS)(
            np.zeros(jax.local_device_count()))
        # Arrays placed as pmap places its outputs (a mesh of the local devices named AXIS):
        # inputs sharded like the outputs of the step before hit the same compiled program.
        self.stacked = index.sharding
        self.local_devices = list(self.stacked.mesh.devices.flat)
        where = np.asarray(index)
        if not np.array_equal(where, where[0] + np.arange(len(where))):
            raise ToolkitError(f"jax-pmap: this process's devices are {where.tolist()} on the "
                               "pmap axis", "they must be consecutive (one process's devices "
                               "together)")
        self.where = [int(i) for i in where]
        self._pfull = _FirstCallBarrier(
            jax.pmap(lambda t: lax.all_gather(t, AXIS), axis_name=AXIS), self.host.barrier)

    def _collectives(self) -> DeviceAxisCollectives:
        return DeviceAxisCollectives(self.host.jax.lax, self.grid)

    def _stacked(self, host: np.ndarray):
        return self.host.jax.device_put(host, self.stacked)

    def _per_stage(self, host: np.ndarray):
        return self._stacked(np.stack([host[self.grid.stage_of(i)] for i in self.where]))

    def _per_device(self, host: np.ndarray):
        return self._per_stage(host)  # (every array here is a row per device)

    def _zeros(self, shape: tuple[int, ...], dtype=None):
        return self._stacked(np.zeros((len(self.where),) + tuple(shape),
                                      dtype or self.host.dtype_name))

    def _batch(self, local: np.ndarray):
        return self._stacked(local.reshape((len(self.where), -1) + local.shape[1:]))

    def _scalars(self, host: np.ndarray) -> np.ndarray:
        return host  # broadcast to every device (in_axes None)

    def _full(self, flat) -> np.ndarray:
        """Every stage's vector on every process (an all-gather: every process calls)."""
        every = np.asarray(self._pfull(flat).addressable_data(0))
        every = every.reshape(self.layout.stages * self.D, -1)
        return every[[self.grid.rank(s, 0) for s in range(self.layout.stages)]]

    def _compile(self, n: int, xi: np.ndarray, yi: np.ndarray) -> None:
        """The step's pmapped programs for a global batch of ``n`` rows (compiled at their
        first calls, each after a barrier)."""
        jax, barrier = self.host.jax, self.host.barrier
        progs = self._programs(n, xi.shape, xi.dtype)
        pmap = partial(jax.pmap, axis_name=AXIS)
        prepare = pmap(progs.prepare)
        self._prepare = [_FirstCallBarrier(prepare, barrier) for _ in (xi, yi)]
        self._exchange = {(f, b): _FirstCallBarrier(pmap(progs.exchange(f, b),
                                                         donate_argnums=(0,)), barrier)
                          for f in (False, True) for b in (False, True) if f or b}
        self._update = _FirstCallBarrier(pmap(progs.update, in_axes=(0, 0, 0, 0, None, 0, 0),
                                              donate_argnums=(0, 1, 2)), barrier)
        self.box = self._zeros(progs.box_shape(self.plan.slots), progs.box_dtype)
        self.losses = self._zeros((self.layout.micro_batches, progs.mb))
