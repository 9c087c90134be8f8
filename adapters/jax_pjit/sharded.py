"""jax-pjit's sharded layouts (ZeRO stages 1-3 / FSDP, and tensor parallelism of the GPT).

The state lives in flat per-unit buffers (``adapters._jax.flat_units.FlatUnits``, padded to a
multiple of the ``data`` axis's size, so any device count works, 3 included) on a
``(data, model)`` mesh of every process's devices, process-major (a process's devices hold
consecutive shards). The jitted step unflattens the buffers into the model's parameters; where a
buffer is sharded, the compiler inserts the all-gather, and where a result is constrained to a
sharded layout, the reduce-scatter:

- stage 1: parameters replicated ``P()``; the gradient replicated (all-reduced) and kept; each
  device updates its shard ``P("data")`` of the parameters (its optimizer state is only that
  shard), and the updated shards are all-gathered back into the replicated parameters.
- stage 2: as 1, but the gradient is constrained to ``P("data")``
  (``jax.lax.with_sharding_constraint``), so the compiler reduce-scatters it.
- stage 3: the parameters, too, are held as ``P("data")`` shards between steps; the compiler
  gathers them for the forward and backward passes (XLA schedules and frees the gathered
  buffers itself, without per-unit activation checkpointing: that is jax-pmap's explicit FSDP).

The mesh is ``(replicate, data, model)``, the launch's device order (tensor innermost). A
composed layout (``toolkit.ParallelDims``) sets its sizes: ``sharded:Z+replicate:R`` is HSDP,
the state sharded over ``data`` inside each of ``R`` replicas and the batch split over both
(the compiler all-reduces each shard's gradient across the replicas); ``data+tensor:k`` is
tensor parallelism over plain data parallelism (ZeRO stage 0: every state replicated over
``data``).

``tensor_parallel=k`` (a ``toolkit.GPT`` only) makes the ``model`` axis ``k`` long: the
attention and MLP kernels are split over ``model`` (``adapters._jax.tensor_parallel``), kept
as ``(k, M)`` arrays sharded ``P("model", "data")``; every other parameter stays in the flat
buffers sharded over ``data``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from adapters._jax import tensor_parallel as tp
from adapters._jax.flat_units import (
    FlatUnits,
    check_layout,
    local_range,
    nbytes,
    state_head,
)
from adapters._jax.native_optax import ShardedOptax, check_sharded, check_sharded_optimizer
from adapters._jax.update import apply_optimizer, squares, update
from adapters.jax_pjit.data_parallel import PjitDataParallel
from toolkit.models.reference import optimizer_slots


class PjitSharded(PjitDataParallel):
    """``toolkit.Sharded(stage, tensor_parallel)`` for ``jax-pjit``: the data-parallel strategy
    with its hooks (``_build_layout``, ``_keep``, ``_full_params``) and state methods replaced."""

    composes = ("sharded", "tensor", "replicate")  # (Backend.setup: dimensions it runs)
    batch_axes = ("replicate", "data")  # the replicas' and the shards' samples

    @staticmethod
    def check_layout(layout) -> None:
        check_layout("jax-pjit", layout, tensor_parallel_ok=True)

    # ------------------------------------------------------------------ build
    def _build_layout(self, model, optimizer, loss, seed, accumulation_steps, metrics):
        jax = self.jax
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        check_sharded_optimizer(self.name, optimizer)
        params, _, model_state = self._build_common(model, optimizer, loss, seed,
                                                    accumulation_steps, metrics, init_opt=False)
        dims = self.layout.dims
        k, stage, replicas = dims.tensor, dims.zero, dims.replicate
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        if k > 1:
            tp.check(model, k, len(devices), self.model.native)
        shards = dims.grid(len(devices)).extent("data")
        # replicate outermost, tensor innermost (check_layout): the launch's device order
        self.mesh = Mesh(np.asarray(devices).reshape(replicas, shards, k),
                         ("replicate", "data", "model"))
        self._ns = lambda *dims: NamedSharding(self.mesh, PartitionSpec(*dims))
        self.replicated, self.batch = self._ns(), self._ns(self.batch_axes)
        self.spec = model if k > 1 else None
        self.split = tp.split_names(model) if k > 1 else ()
        self.units = FlatUnits(self.model, shards, exclude=self.split)
        named = self.model.flat(params)
        self.views = {n: tp.to_view(n, named[n], model, np).shape for n in self.split}
        sharded, full = self._store_shardings(True), self._store_shardings(False)
        self.param_sharding = sharded if stage == 3 else full
        self.grad_sharding = sharded if stage >= 2 else full
        # where the optimizer state and its update live: shards, or (zero 0) whole copies
        held = self.held_sharding = sharded if stage else full
        host = self._to_store(named)
        zeros = jax.tree_util.tree_map(np.zeros_like, host)
        self.params = self._place(host, self.param_sharding)
        self.optax = None  # a native optax state's conversions (ShardedOptax)
        if self.opt_spec is None:
            check_sharded(self.name, self.layout, self.tx, self.model)
            self.optax = ShardedOptax(self.model, host, self._host, self._replicate)
            opt_sharding = self.optax.shardings(jax.eval_shape(self.tx.init, host), held,
                                                self.replicated)
            self.opt_state = jax.jit(self.tx.init, out_shardings=opt_sharding)(self.params)
        else:
            opt_sharding = {slot: held for slot in optimizer_slots(optimizer)}
            self.opt_state = {slot: self._place(zeros, held) for slot in opt_sharding}
        self.grads = self._place(zeros, self.grad_sharding)  # replaced by each step's
        self.model_state = self._replicate(model_state)
        repl, batch = self.replicated, self.batch
        self._jstep = jax.jit(
            self._sharded_step,
            in_shardings=(self.param_sharding, opt_sharding, repl, batch, batch, repl, repl),
            out_shardings=(self.param_sharding, opt_sharding, repl, batch, self.grad_sharding,
                           repl),
            donate_argnums=(0, 1, 2))
        self._jfull = jax.jit(self._named_full, out_shardings=repl)
        # Checkpoint pieces of split tensors: each tensor flattened and cut over all devices.
        self._jflat = jax.jit(self._flat_tensors,
                              out_shardings=self._ns(("replicate", "data", "model")))
        self._jeval = jax.jit(self._eval_fn)

    def _store_shardings(self, sharded: bool) -> dict[str, Any]:
        """The shardings of a state store: ``{"units": {unit: ...}, "split": {name: ...}}``."""
        ns = self._ns
        return {"units": {u: ns("data") if sharded else ns() for u in self.units.layouts},
                "split": {n: ns("model", "data") if sharded else ns("model", None)
                          for n in self.split}}

    def _to_store(self, named: dict[str, np.ndarray]) -> dict[str, Any]:
        """Host arrays by neutral name -> a host store (flat units; split tensors as padded
        ``(k, M)`` rows, row r the part of model-parallel rank r)."""
        k, d = self.layout.dims.tensor, self.units.shards
        split = {}
        for n in self.split:
            rows = tp.to_view(n, np.asarray(named[n]), self.spec, np).reshape(k, -1)
            split[n] = np.pad(rows, ((0, 0), (0, -rows.shape[1] % d)))
        return {"units": self.units.flatten(named), "split": split}

    def _place(self, host: dict[str, Any], shardings: dict[str, Any]) -> dict[str, Any]:
        jax = self.jax
        return jax.tree_util.tree_map(
            lambda a, s: jax.make_array_from_callback(a.shape, s, lambda idx: a[idx]),
            host, shardings)

    # ------------------------------------------------------------------ inside jit
    def _named(self, store: dict[str, Any]) -> dict[str, Any]:
        """A store -> parameters by neutral name (split tensors as their views).

        Each buffer is gathered whole first (one all-gather per unit, as FSDP2 gathers a
        module's parameters at once; its transpose, one reduce-scatter), then cut locally.
        Cutting the sharded buffer directly lets the compiler gather every tensor on its own
        and move the slices across shard boundaries with collective-permutes: 90 collectives
        per step for the 2-block GPT instead of about 10, each a cross-process round trip.
        """
        held = ("data",) if self.layout.dims.zero == 3 else ()
        # stage 3: a mixed-precision forward's cast stays on the shards, so the gather
        # carries the compute dtype (else the compiler gathers float32 and casts after)
        whole = {u: self._constrain(self._constrain(b, held), ())
                 for u, b in store["units"].items()}
        named = self.units.named(whole)
        for n, shape in self.views.items():  # each row's padding dropped
            row = math.prod(shape) // self.layout.dims.tensor
            rows = self._constrain(self._constrain(store["split"][n], ("model", *held)),
                                   ("model", None))
            named[n] = rows[:, :row].reshape(shape)
        return named

    def _named_full(self, store: dict[str, Any]) -> dict[str, Any]:
        """A store -> every tensor by neutral name in its original layout."""
        named = self._named(store)
        for n in self.split:
            named[n] = tp.from_view(n, named[n], self.spec, self.jnp)
        return named

    def _flat_tensors(self, store: dict[str, Any]) -> dict[str, Any]:
        size = self.mesh.devices.size
        return {n: self.jnp.pad(v.reshape(-1), (0, -v.size % size))
                for n, v in self._named_full(store).items()}

    def _constrain(self, a, dims):
        return self.jax.lax.with_sharding_constraint(a, self._ns(*dims))

    def _sharded_forward(self, store, model_state, xb, rng):
        named = self._named(store)
        if not self.split:
            tree = self.model.unflat(named, self.model.params)
            return self.model.apply(tree, model_state, xb, train=True, rng=rng)
        for n in self.split:  # each model-parallel rank computes with its part only
            named[n] = self._constrain(named[n], ("model",) + (None,) * (named[n].ndim - 1))
        # (the activations' batch axis: the shards' and the replicas' samples, HSDP)
        batch = self.batch_axes
        return tp.forward(named, xb, self.spec, lambda a, dims: self._constrain(
            a, tuple(batch if d == "data" else d for d in dims)), self.recompute), model_state

    def _sharded_step(self, params, opt_state, model_state, x, y, scalars, seed):
        wsc = self.jax.lax.with_sharding_constraint
        key = self.jax.random.PRNGKey(seed)
        jnp, before = self.jnp, (params, opt_state, model_state)
        scale = self.loss_scale(scalars)
        grads, losses, new_state = self._accumulated_grads(
            params, model_state, x, y, key, forward=self._sharded_forward, scale=scale)
        # stage 1: the full gradient (all-reduced) is kept; 2 and 3: only its shard
        # (reduce-scattered). Either way each device updates its own shard.
        grads = wsc(grads, self.grad_sharding)
        shards = self.held_sharding
        # the norm: every element once (flat buffers with zero padding, and the split kernels'
        # (k, M) views)
        (params, opt_state, model_state), norm = update(
            jnp, self.rule, grads, lambda g: squares(jnp, g),
            lambda g: (*apply_optimizer(self.rule, self.tx, wsc(g, shards), opt_state,
                                        wsc(params, shards), scalars), new_state),
            before, scalars)
        return params, opt_state, model_state, losses, grads, norm

    # ------------------------------------------------------------------ host side
    def _host_named(self, store) -> dict[str, np.ndarray]:
        """Every tensor of a store gathered (a collective: every process calls it)."""
        return {n: np.asarray(a.addressable_data(0)) for n, a in self._jfull(store).items()}

    def _full_params(self):
        return self.model.unflat(self._host_named(self.params), self.model.params)

    def _keep(self, out) -> None:
        self.grads = out[4]  # the gradient this layout keeps (memory_bytes counts it)

    def state_dict(self) -> dict[str, np.ndarray]:
        unflat, like = self.model.unflat, self.model.params
        if self.optax is not None:
            opt = self.optax.to_tree(self.opt_state, self._host_named)
        else:
            opt = {slot: unflat(self._host_named(s), like) for slot, s in self.opt_state.items()}
        return self._export(self._full_params(), opt, self._host(self.model_state))

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        like = self.model.params
        params, opt_state, model_state = self._import(
            state, like, self.optax.like(self.opt_state) if self.optax is not None else
            {slot: like for slot in self.opt_state}, self._host(self.model_state))
        sharded = self._store_shardings(True)
        self.params = self._place(self._to_store(self.model.flat(params)),
                                  self.param_sharding)
        if self.optax is not None:
            self.opt_state = self.optax.from_tree(
                opt_state, lambda named: self._place(self._to_store(named), sharded))
        else:
            self.opt_state = {slot: self._place(self._to_store(self.model.flat(tree)), sharded)
                              for slot, tree in opt_state.items()}
        self.model_state = self._replicate(model_state)

    def sharded_state(self):
        """``(replicated, pieces)`` (see :class:`toolkit.ShardedAdapter`): this process's
        devices' consecutive shards of each unit (``FlatLayout.owned``), or with tensor
        parallelism, its consecutive part of each split tensor flattened over all devices."""
        replicated, stores = state_head(self, self._host(self.model_state),
                                        lambda: self._host_named(self.params))
        pieces = {}
        # (HSDP: the first replica's processes write the shards; the others' pieces are empty)
        me = self.jax.process_index()
        first = any(i[0] == 0 for i, d in np.ndenumerate(self.mesh.devices)
                    if d.process_index == me)
        for key, store in stores:
            if not self.split:
                for unit, array in store["units"].items():
                    lo, data = local_range(array)
                    pieces.update(self.units.pieces(unit, lo, data if first else data[:0], key))
                continue
            shapes = {n: np.shape(v) for n, v in self.model.flat(self.model.params).items()}
            for n, array in self._jflat(store).items():
                lo, data = local_range(array)  # padding lies at the end: cut it off
                piece = data[:max(0, math.prod(shapes[n]) - lo)]
                pieces[key(n)] = (np.ascontiguousarray(piece), 0, shapes[n])
        return replicated, pieces

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of this process's device buffers (every local device's shards, so a
        replicated buffer counts once per local device): parameters, the kept gradient,
        optimizer slots."""
        params = nbytes(self.params)
        return {"params": params, "grads": nbytes(self.grads),
                "optimizer": nbytes(self.opt_state)}
