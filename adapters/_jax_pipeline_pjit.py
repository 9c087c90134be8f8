"""jax-pjit's pipeline layout (``toolkit.Pipeline``): a ``(stage, data)`` mesh of every process's
devices, stages exchanging activations and their gradients with ``lax.ppermute`` inside
``jax.shard_map``.

Ranks. The mesh is every device, process-major, reshaped ``(S, D)``: device ``i`` is stage
``i // D`` of replica ``i % D`` (``toolkit.PipelineGrid``'s order applied to devices, so one
process per device gives exactly its rank mapping; a process with ``L`` devices holds ``L``
consecutive replicas of one stage, or, alone, several stages). Samples (``samples=``):
``"replica"`` (the Trainer under a Pipeline layout): the sampler gives the ``S`` processes of
a process-replica the same local batch, each of its devices takes its ``1/L`` slice, so device
replica ``d`` cuts its ``B / D`` samples into ``M`` micro-batches; ``"process"`` (every process
its own samples, e.g. one process holding both stages): each device takes a ``1/L`` slice and a
replica's batch is its ``S`` devices' slices gathered over ``stage``. Either way the loss is the
mean over the global batch and gradients are summed over ``data`` (each backward scales by
``1 / B``).

Execution. One step is four kinds of jitted programs, each called by every process in the same
order: ``prepare`` (the gather of the inputs and labels), per lockstep round one ``compute``
(every device runs its stage's action of the round through ``lax.switch``: no collective, so each
process times its own stages' forwards and backwards) and one ``exchange`` per wave of messages
(``ppermute`` forward and/or backward over ``stage``; its time is the send/receive, waiting for
the neighbour included), and ``update`` (``psum`` of gradients over ``data``, the tied embedding's
over the holders on ``stage``, the elementwise optimizer). Every compute and exchange is timed on
the host (dispatch to ``block_until_ready``) into a ``toolkit.StageRecorder`` per local stage.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from adapters._common import loss_name
from adapters._flax_models import per_sample_loss
from adapters._jax import LocalMean, apply_optimizer, make_optimizer
from adapters._jax_pipeline import RoundPlan, eval_sums, stage_model
from toolkit import SGD, Adam, Pipeline, ToolkitError
from toolkit._partition import micro_batch_size
from toolkit._reference import optimizer_slots
from toolkit._schedules import pipeline_schedule
from toolkit._timeline import TIMELINE_ENV, StageRecorder, append_timeline


class PjitPipeline:
    """The pipeline layout of a ``JaxPjitAdapter``: the adapter delegates ``build``,
    ``train_step``, ``evaluate``, ``state_dict``, ``load_state_dict``, ``sharded_state`` and
    ``memory_bytes`` to it.

    Args:
        adapter: the (set up) ``JaxPjitAdapter``; its ``jax``, ``env``, dtype, optimizer scalars
            (``_scalars``), ``_inputs``/``_labels`` and ``barrier`` are used.
        layout: a ``toolkit.Pipeline``.
        keep_steps: steps of timeline records kept (the latest).
    """

    def __init__(self, adapter: Any, layout: Pipeline, samples: str = "replica",
                 keep_steps: int = 4):
        if samples not in ("replica", "process"):
            raise ToolkitError(f"samples={samples!r}", "use 'replica' or 'process'")
        if not isinstance(layout, Pipeline):
            raise ToolkitError(f"{layout!r} is not a toolkit.Pipeline",
                               "pass toolkit.Pipeline(stages=..., micro_batches=...)")
        self.a, self.layout, self.keep_steps = adapter, layout, keep_steps
        self.samples = samples
        self.schedule = pipeline_schedule(layout.schedule, layout.stages, layout.micro_batches,
                                          layout.chunks)
        self.plan = RoundPlan(self.schedule)
        self.step_index = 0
        self.recorders: dict[int, StageRecorder] = {}

    # ------------------------------------------------------------------ build
    def build(self, model: Any, optimizer: Any, loss: Any, *, seed: int = 0,
              accumulation_steps: int = 1, sync_batchnorm: bool = False,
              metrics: Any = None) -> None:
        a, jax = self.a, self.a.jax
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        name, S = a.name, self.layout.stages
        if accumulation_steps != 1:
            raise ToolkitError(f"{name}: accumulation_steps={accumulation_steps} with a pipeline",
                               "the pipeline's micro-batches accumulate already: use "
                               "accumulation_steps=1 and Pipeline(micro_batches=...)")
        if not isinstance(optimizer, SGD | Adam):
            raise ToolkitError(f"{name}: a pipeline updates flat per-stage vectors with the "
                               f"toolkit's elementwise optimizers, not {type(optimizer).__name__}",
                               "pass toolkit.SGD(...) or toolkit.Adam(...)")
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        if len(devices) % S:
            raise ToolkitError(
                f"{name}: {len(devices)} devices ({a.env.world_size} processes x "
                f"{jax.local_device_count()} local) do not divide into {S} pipeline stages",
                f"launch a multiple of {S} devices in all, or use a number of stages that "
                f"divides {len(devices)}")
        P = a.env.world_size
        if self.samples == "replica" and P % S:
            raise ToolkitError(
                f"{name}: {P} processes are not a multiple of the {S} pipeline stages",
                f"launch a multiple of {S} processes (the sampler gives each pipeline replica "
                "of processes its samples)")
        self.staged = stage_model(model, self.layout, seed, a.dtype_name, name)
        self.loss_name, self.loss_fn = loss_name(loss), loss
        a.loss_name, a.loss_fn = self.loss_name, loss  # the adapter's _labels reads it
        self.metrics = dict(metrics or {})
        a.opt_spec, a.count, a.steps = optimizer, 0, 0
        self.tx = make_optimizer(optimizer, name)
        self.D = len(devices) // S
        self.mesh = Mesh(np.asarray(devices).reshape(S, self.D), ("stage", "data"))
        self._ns = lambda *dims: NamedSharding(self.mesh, PartitionSpec(*dims))
        host = self.staged.flatten(self.staged.init, a.dtype_name)
        if a.env.world_size > 1:  # rank 0's initial parameters become everyone's
            from jax.experimental import multihost_utils

            host = np.asarray(multihost_utils.broadcast_one_to_all(host))
        self.slots = optimizer_slots(optimizer)
        self._set_state(host, {s: np.zeros_like(host) for s in self.slots})
        self.grads = self._zeros((S, self.D, self.staged.length), ("stage", "data"))
        self.ctrl = [(self._place(r.ctrl), [self._place(w.ctrl) for w in r.waves])
                     for r in self.plan.rounds]
        local = {(i // self.D, i % self.D) for i, d in enumerate(devices)
                 if d.process_index == jax.process_index()}
        self.local_stages = sorted({s for s, _ in local})
        first = next(i for i, d in enumerate(devices) if d.process_index == jax.process_index())
        self.position = (first // self.D, (first % self.D) // jax.local_device_count())
        self.recorders = {s: StageRecorder(s, min(d for t, d in local if t == s))
                          for s in self.local_stages}
        self._compiled_for = None
        self._jfull = jax.jit(lambda t: t, out_shardings=self._ns())

    def _place(self, host: np.ndarray, dims=("stage",)):
        jax = self.a.jax
        return jax.make_array_from_callback(host.shape, self._ns(*dims), lambda i: host[i])

    def _zeros(self, shape, dims, dtype=None):
        return self._place(np.zeros(shape, dtype or self.a.dtype_name), dims)

    def _set_state(self, params: np.ndarray, opt: dict[str, np.ndarray]) -> None:
        self.params = self._place(params)
        self.opt_state = {s: self._place(v) for s, v in opt.items()}

    # ------------------------------------------------------------------ programs
    def _compile(self, xg, yg) -> None:
        """Builds and compiles the step's programs for these batch shapes, then a barrier
        (no process starts a collective while another still compiles: jax issue 40831)."""
        jax, jnp, lax = self.a.jax, self.a.jnp, self.a.jax.lax
        P, staged, plan = self._ns, self.staged, self.plan
        S, D, M, K = self.layout.stages, self.D, self.layout.micro_batches, staged.pieces
        n, gather = xg.shape[0], self.samples == "process"
        # "process": every process's samples differ, a replica gathers its S devices' shares;
        # "replica": a replica's S processes hold the same samples (n counts them S times).
        mb = micro_batch_size(n // D if gather else n // (S * D), M)
        inv_b = 1.0 / n if gather else S / n
        spec = jax.sharding.PartitionSpec
        smap = jax.shard_map

        def prepare(x):
            whole = lax.all_gather(x, "stage", axis=0, tiled=True) if gather else x
            return whole.reshape((1, 1, M, mb) + x.shape[1:])

        self._prepare = jax.jit(smap(prepare, mesh=self.mesh, in_specs=spec(("stage", "data")),
                                     out_specs=spec("stage", "data")))
        xs = jax.eval_shape(self._prepare, xg)
        ys = jax.eval_shape(self._prepare, yg)
        # Per-sample activation shapes at every cut, from the pieces themselves.
        shapes, h = [], jax.ShapeDtypeStruct((mb,) + xg.shape[1:], xg.dtype)
        for k in range(K):
            p = {nm: jax.ShapeDtypeStruct(np.shape(staged.init[nm]), self.a.dtype)
                 for nm in staged.piece_names[k]}
            h = jax.eval_shape(staged.fns[k], p, h)
            shapes.append(h)
        width = max([int(np.prod(s.shape[1:])) for s in shapes[:-1]] or [1])
        box_shape = (S, D, plan.slots, mb, width)
        self.box = self._zeros(box_shape, ("stage", "data"))
        self.losses = self._zeros((S, D, M, mb), ("stage", "data"))

        def pack(h):
            flat = h.reshape(mb, -1)
            return jnp.pad(flat, ((0, 0), (0, width - flat.shape[1])))

        def unpack(row, k):  # the input of piece k (the output of piece k - 1)
            like = shapes[k - 1]
            return row[:, :int(np.prod(like.shape[1:]))].reshape(like.shape).astype(like.dtype)

        def forward(k):
            def run(p, g, bx, ls, x, y, m, a_in, g_in, out):
                h = x[m] if k == 0 else unpack(bx[a_in], k)
                o = staged.fns[k](staged.piece_params(p, k), h)
                if k == K - 1:
                    return g, bx, ls.at[m].set(per_sample_loss(jnp, self.loss_fn, o, y[m]))
                return g, bx.at[out].set(pack(o)), ls
            return run

        def backward(k):
            def run(p, g, bx, ls, x, y, m, a_in, g_in, out):
                params = staged.piece_params(p, k)
                h = x[m] if k == 0 else unpack(bx[a_in], k)
                if k == K - 1:
                    def objective(pp, hh):
                        return jnp.sum(per_sample_loss(jnp, self.loss_fn,
                                                       staged.fns[k](pp, hh), y[m])) * inv_b
                    gp, gh = jax.grad(objective, argnums=(0, 1), allow_int=True)(params, h)
                else:
                    _, vjp = jax.vjp(staged.fns[k], params, h)
                    gp, gh = vjp(unpack(bx[g_in], k + 1).astype(shapes[k].dtype))
                g = staged.add_grads(g, k, gp)
                return g, (bx if k == 0 else bx.at[out].set(pack(gh))), ls
            return run

        def idle(p, g, bx, ls, x, y, m, a_in, g_in, out):
            return g, bx, ls

        branches = [idle] + [f for k in range(K) for f in (forward(k), backward(k))]

        def compute(p, g, bx, ls, x, y, c):
            c = c[0]
            # The stage's parameters are the same on every replica; as invariant inputs, their
            # gradients inside shard_map would be summed over ``data`` implicitly. Varying
            # copies keep each replica's own gradient (``update`` sums them once).
            p = lax.pcast(p, "data", to="varying")
            g, bx, ls = lax.switch(c[0], branches, p[0], g[0, 0], bx[0, 0], ls[0, 0], x[0, 0],
                                   y[0, 0], c[1], c[2], c[3], c[4])
            return g[None, None], bx[None, None], ls[None, None]

        sd = spec("stage", "data")
        self._compute = jax.jit(smap(compute, mesh=self.mesh,
                                     in_specs=(spec("stage"), sd, sd, sd, sd, sd, spec("stage")),
                                     out_specs=(sd, sd, sd)), donate_argnums=(1, 2, 3))
        cyclic = self.layout.chunks > 1  # the last stage's chunk feeds stage 0's next chunk
        fwd = [(s, (s + 1) % S) for s in range(S if cyclic else S - 1)]
        bwd = [((s + 1) % S, s) for s in range(S if cyclic else S - 1)]

        def exchange(forward_, backward_):
            def run(bx, c):
                bx, c = bx[0, 0], c[0]
                sent_f, sent_b = bx[c[0]], bx[c[1]]  # read before any receive writes
                if forward_:
                    got = lax.ppermute(sent_f, "stage", fwd)
                    bx = bx.at[c[2]].set(jnp.where(c[3] > 0, got, bx[c[2]]))
                if backward_:
                    got = lax.ppermute(sent_b, "stage", bwd)
                    bx = bx.at[c[4]].set(jnp.where(c[5] > 0, got, bx[c[4]]))
                return bx[None, None]
            return jax.jit(smap(run, mesh=self.mesh, in_specs=(sd, spec("stage")),
                                out_specs=sd), donate_argnums=(0,))

        self._exchange = {(f, b): exchange(f, b) for f in (False, True) for b in (False, True)
                          if f or b}
        mask = staged.holders_mask().astype(self.a.dtype_name)
        shared = staged.n_shared

        def update(p, opt, g, ls, scalars):
            g = lax.psum(g[0, 0], "data")
            if shared:  # the tied embedding: first and last stage add their gradients
                holder = jnp.asarray(mask)[lax.axis_index("stage")]
                total = lax.psum(g[:shared] * holder, "stage")
                g = g.at[:shared].set(jnp.where(holder > 0, total, g[:shared]))
            opt = {s: v[0] for s, v in opt.items()}
            p, opt = apply_optimizer(self.tx, g, opt, p[0], scalars)
            loss = lax.psum(jnp.sum(ls), ("stage", "data")) * inv_b
            return (p[None], {s: v[None] for s, v in opt.items()},
                    jnp.zeros_like(g)[None, None], loss)

        st = spec("stage")
        opt_specs = {s: st for s in self.slots}
        self._update = jax.jit(smap(update, mesh=self.mesh,
                                    in_specs=(st, opt_specs, sd, sd, spec()),
                                    out_specs=(st, opt_specs, sd, spec())),
                               donate_argnums=(0, 1, 2))
        # Compile everything now (the first round's arguments stand for every round's).
        self._prepare_c = (self._prepare.lower(xg).compile(), self._prepare.lower(yg).compile())
        dummy = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=P("stage", "data"))
                 for s in (xs, ys)]
        first = self.ctrl[0][0]
        self._compute_c = self._compute.lower(self.params, self.grads, self.box, self.losses,
                                              *dummy, first).compile()
        wave = next((w for _, ws in self.ctrl for w in ws), None)
        self._exchange_c = {key: fn.lower(self.box, wave).compile()
                            for key, fn in self._exchange.items() if wave is not None}
        scalars = self._place(np.zeros(3, self.a.dtype_name), ())
        self._update_c = self._update.lower(self.params, self.opt_state, self.grads,
                                            self.losses, scalars).compile()
        self._compiled_for = (xg.shape, xg.dtype, yg.shape, yg.dtype)
        self.a.barrier()

    # ------------------------------------------------------------------ training
    def _global(self, local: np.ndarray):
        return self.a.jax.make_array_from_process_local_data(self._ns(("stage", "data")), local)

    def train_step(self, x: np.ndarray, y: np.ndarray, lr: float | None) -> LocalMean:
        """One step on this process's samples; returns the global batch's mean loss (the same
        on every process, so the Trainer's average over processes is that mean)."""
        a, jax = self.a, self.a.jax
        local = jax.local_device_count()
        if len(x) % local:
            raise ToolkitError(
                f"{a.name}: the local batch of {len(x)} samples does not split over {local} "
                "local devices", f"use a global batch divisible by all {self.mesh.size} devices")
        xg, yg = self._global(a._inputs(x)), self._global(a._labels(y))
        replica_batch = xg.shape[0] // self.D // (1 if self.samples == "process" else
                                                  self.layout.stages)
        if replica_batch % self.layout.micro_batches:
            micro_batch_size(replica_batch, self.layout.micro_batches)  # its error and hint
        if self._compiled_for != (xg.shape, xg.dtype, yg.shape, yg.dtype):
            self._compile(xg, yg)
        step, clock = self.step_index, time.time
        xs, ys = self._prepare_c[0](xg), self._prepare_c[1](yg)
        for (ctrl, waves), rnd in zip(self.ctrl, self.plan.rounds, strict=True):
            if any(act is not None for act in rnd.compute):
                start = clock()
                self.grads, self.box, self.losses = self._compute_c(
                    self.params, self.grads, self.box, self.losses, xs, ys, ctrl)
                self.box.block_until_ready()
                end = clock()
                for s in self.local_stages:
                    if rnd.compute[s] is not None:
                        self.recorders[s].add(rnd.compute[s], start, end, step)
            for wctrl, wave in zip(waves, rnd.waves, strict=True):
                start = clock()
                self.box = self._exchange_c[(wave.forward, wave.backward)](self.box, wctrl)
                self.box.block_until_ready()
                end = clock()
                for s in self.local_stages:
                    for act in wave.actions[s]:
                        self.recorders[s].add(act, start, end, step)
        scalars = self._place(a._scalars(lr), ())
        a.steps += 1
        self.params, self.opt_state, self.grads, loss = self._update_c(
            self.params, self.opt_state, self.grads, self.losses, scalars)
        self.step_index += 1
        folder = os.environ.get(TIMELINE_ENV)
        for s, rec in self.recorders.items():
            if folder:  # TOOLKIT_PIPELINE_TIMELINE=DIR: python -m toolkit.pipeline_timeline DIR
                append_timeline([r for r in rec.records if r["step"] == step], folder, s,
                                rec.replica)
            rec.records = [r for r in rec.records if r["step"] > step - self.keep_steps]
        return LocalMean([loss.addressable_data(0)])

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
        return self.staged.unflatten(np.asarray(self._jfull(flat).addressable_data(0)))

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
        """Local sums over ``x`` (the whole model on this process's first device)."""
        jax = self.a.jax
        params = self._named(self.params)
        if not hasattr(self, "_jeval"):
            self._jeval = jax.jit(eval_sums(self.staged, self.loss_fn, self.loss_name,
                                            self.metrics))
        sums = self._jeval(params, self.a._inputs(x), self.a._labels(y))
        return {**{k: float(v) for k, v in sums.items()}, "count": float(len(x))}

    def state_dict(self) -> dict[str, np.ndarray]:
        """Full tensors under the neutral names, on every process."""
        out = {f"params/{n}": v for n, v in self._named(self.params).items()}
        for slot, flat in self.opt_state.items():
            out.update({f"opt/{slot}/{n}": v for n, v in self._named(flat).items()})
        if isinstance(self.a.opt_spec, Adam):
            out["opt/count"] = np.asarray(self.a.count, np.int64)
        return out

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        dtype, names = self.a.dtype_name, self.staged.names()
        missing = [f"params/{n}" for n in names if f"params/{n}" not in state]
        if missing:
            raise ToolkitError(f"the state lacks {missing[:3]} (of {len(missing)})",
                               "load a checkpoint of the same model")
        params = self.staged.flatten({n: state[f"params/{n}"] for n in names}, dtype)
        opt = {s: self.staged.flatten({n: state[f"opt/{s}/{n}"] for n in names}, dtype)
               for s in self.slots}
        self._set_state(params, opt)
        if "opt/count" in state:
            self.a.count = int(state["opt/count"])

    def sharded_state(self):
        """``(replicated, pieces)`` for a checkpoint: replica 0 of each stage gives each of its
        parameters (and optimizer slots) whole as one flat piece, a shared one only from its
        first holder; every other process gives an empty piece of every name."""
        replicated = ({"opt/count": np.asarray(self.a.count, np.int64)}
                      if isinstance(self.a.opt_spec, Adam) else {})
        mine: dict[int, dict[str, np.ndarray]] = {}
        trees = {"params": self.params, **{f"opt/{s}": v for s, v in self.opt_state.items()}}
        pieces = {}
        for prefix, arr in trees.items():
            for shard in arr.addressable_shards:
                s = shard.index[0].start or 0
                if shard.device == self.mesh.devices[s, 0]:
                    mine[s] = np.asarray(shard.data)[0]
            for name in self.staged.names():
                s = self.staged.owner_stage(name)
                off, shape = self.staged.offsets[s][name]
                piece = (mine[s][off:off + int(np.prod(shape))].copy() if s in mine
                         else np.zeros(0, self.a.dtype_name))
                pieces[f"{prefix}/{name}"] = (piece, 0, shape)
            mine.clear()
        return replicated, pieces

    def memory_bytes(self) -> dict[str, int]:
        """Bytes on this process's devices between steps, from the arrays' own shards."""
        def held(*arrays):
            return int(sum(s.data.nbytes for a in arrays for s in a.addressable_shards))

        out = {"params": held(self.params), "grads": held(self.grads),
               "optimizer": held(*self.opt_state.values())}
        if hasattr(self, "box"):
            out["activations"] = held(self.box)
        return out

    def sync_state(self) -> None:
        """Nothing to synchronise: pipeline stages carry parameters only."""
