"""jax-pjit's pipeline layout (``toolkit.Pipeline``): a ``(stage, data)`` mesh of every process's
devices, stages exchanging activations and their gradients with ``lax.ppermute`` inside
``jax.shard_map``.

Ranks. The mesh holds every device, process-major, at the place the layout's
``toolkit.PipelineGrid`` over the devices gives it (``executor.grid``: mesh cell ``(s, d)`` is
device ``grid.rank(s, d)``), so one process per device gives exactly its rank mapping; a
process with ``L`` devices holds ``L`` consecutive replicas of one stage, or, alone, several
stages. Samples: see ``adapters._jax.pipeline.PipelineExecutor`` (each device takes its slice
of its process's local batch); gradients are summed over ``data`` (each backward scales by
``1 / B``).

Execution. One step is three kinds of jitted programs over the mesh, each called by every process
in the same order: ``prepare`` (the gather of the inputs and labels), one ``exchange`` per wave of
messages (``ppermute`` forward and/or backward over ``stage``; its time is the send/receive,
waiting for the neighbour included), and ``update`` (``psum`` of gradients over ``data``, the tied
embedding's over the holders on ``stage``, the elementwise optimizer, a native model's state
averaged over ``data``). The bodies are
``adapters._jax.programs.StagePrograms``, shared with jax-pmap; here each is wrapped in
``shard_map`` (one device's block of every array, leading ``(1, 1)`` or ``(1,)`` axes dropped).
A round's forwards and backwards take no collective: each process runs its own devices' actions
as single-device programs on their blocks (``LocalComputes``; the executor times them). Every
compute and exchange is timed on the host into a ``toolkit.StageRecorder`` per local stage.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from adapters._jax.pipeline import PipelineExecutor


class MeshCollectives:
    """The mechanism of ``StagePrograms`` on the ``(stage, data)`` mesh: named-axis
    collectives inside ``shard_map``."""

    def __init__(self, lax):
        self.lax = lax

    def stage(self):
        return self.lax.axis_index("stage")

    def replica_sum(self, x):
        return self.lax.psum(x, "data")

    def holder_sum(self, x):
        return self.lax.psum(x, "stage")

    def total(self, x):
        return self.lax.psum(x, ("stage", "data"))

    def shift(self, x, pairs):
        return self.lax.ppermute(x, "stage", pairs)

    def gather_replica(self, x):
        return self.lax.all_gather(x, "stage", axis=0, tiled=True)


class PjitPipeline(PipelineExecutor):
    """The pipeline layout of a ``JaxPjitAdapter`` (see ``PipelineExecutor`` for the
    arguments)."""

    def device_batch(self, x: np.ndarray, y: np.ndarray):
        """The host batch as it is: the step places its micro-batches itself."""
        return x, y

    def _setup_devices(self, devices) -> None:
        jax, S = self.host.jax, self.layout.stages
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        cells = [[devices[self.grid.rank(s, d)] for d in range(self.D)] for s in range(S)]
        self.mesh = Mesh(np.asarray(cells), ("stage", "data"))
        self._ns = lambda *dims: NamedSharding(self.mesh, PartitionSpec(*dims))
        self.where = [i for i, d in enumerate(devices) if d.process_index == jax.process_index()]
        self.local_devices = [devices[i] for i in self.where]
        self._jfull = jax.jit(lambda t: t, out_shardings=self._ns())

    def _collectives(self) -> MeshCollectives:
        return MeshCollectives(self.host.jax.lax)

    def _place(self, host: np.ndarray, dims):
        return self.host.jax.make_array_from_callback(host.shape, self._ns(*dims),
                                                   lambda i: host[i])

    def _per_stage(self, host: np.ndarray):
        return self._place(host, ("stage",))

    def _per_device(self, host: np.ndarray):
        return self._place(np.repeat(host[:, None], self.D, axis=1), ("stage", "data"))

    def _zeros(self, shape: tuple[int, ...], dtype=None):
        S, D = self.layout.stages, self.D
        return self._place(np.zeros((S, D) + tuple(shape), dtype or self.host.dtype_name),
                           ("stage", "data"))

    def _batch(self, local: np.ndarray):
        """``(S, D, b, ...)``: each local device's slice of the local batch, in the devices'
        order (the mesh's order of cells is the grid's, not the devices')."""
        jax, S = self.host.jax, self.layout.stages
        parts = local.reshape((len(self.local_devices), -1) + local.shape[1:])
        return jax.make_array_from_single_device_arrays(
            (S, self.D) + parts.shape[1:], self._ns("stage", "data"),
            [jax.device_put(p[None, None], d) for p, d in zip(parts, self.local_devices,
                                                                strict=True)])

    def _scalars(self, host: np.ndarray):
        return self._place(host, ())

    def _full(self, flat) -> np.ndarray:
        full = np.asarray(self._jfull(flat).addressable_data(0))
        return full[:, 0] if full.ndim == 3 else full  # (per device: replica 0's)

    def _compile(self, n: int, xi: np.ndarray, yi: np.ndarray) -> None:
        """Builds and compiles the step's programs for a global batch of ``n`` rows shaped like
        ``xi``/``yi``, then a barrier (no process starts a collective while another still
        compiles: jax issue 40831)."""
        jax = self.host.jax
        spec = jax.sharding.PartitionSpec
        progs = self._programs(n, xi.shape, xi.dtype)
        sd, st = spec("stage", "data"), spec("stage")
        smap = partial(jax.shard_map, mesh=self.mesh)

        def prepare(x):
            return progs.prepare(x[0, 0])[None, None]

        def exchange(forward, backward):
            run = progs.exchange(forward, backward)
            return jax.jit(smap(lambda bx, c: run(bx[0, 0], c[0])[None, None],
                                in_specs=(sd, st), out_specs=sd), donate_argnums=(0,))

        tmap = jax.tree_util.tree_map

        def update(p, opt, g, ls, scalars, old, moved):  # (opt: a spec's slots, or optax's)
            p, opt, g, loss, norm, state = progs.update(
                p[0], tmap(lambda v: v[0], opt), g[0, 0], ls[0, 0], scalars, old[0, 0],
                moved[0, 0])
            return (p[None], tmap(lambda v: v[None], opt), g[None, None], loss, norm,
                    state[None, None])

        opt_specs = tmap(lambda _: st, self.opt_state)
        prep = jax.jit(smap(prepare, in_specs=sd, out_specs=sd))
        upd = jax.jit(smap(update, in_specs=(st, opt_specs, sd, sd, spec(), sd, sd),
                           out_specs=(st, opt_specs, sd, spec(), spec(), sd)),
                      donate_argnums=(0, 1, 2))
        self.box = self._zeros(progs.box_shape(self.plan.slots), progs.box_dtype)
        self.losses = self._zeros((self.layout.micro_batches, progs.mb))
        # Compile everything now (the first round's arguments stand for every round's).
        cells = (self.layout.stages, self.D, n // (self.layout.stages * self.D))
        structs = [jax.ShapeDtypeStruct(cells + a.shape[1:], a.dtype,
                                        sharding=self._ns("stage", "data")) for a in (xi, yi)]
        self._prepare = [prep.lower(s).compile() for s in structs]
        wave = next((w for ws in self.ctrl for w in ws), None)
        self._exchange = {(f, b): exchange(f, b).lower(self.box, wave).compile()
                          for f in (False, True) for b in (False, True)
                          if (f or b) and wave is not None}
        scalars = self._place(self.host.scalars_like(), ())
        self._update = upd.lower(self.params, self.opt_state, self.grads, self.losses,
                                 scalars, self.state, self.state).compile()
        self.host.barrier()
