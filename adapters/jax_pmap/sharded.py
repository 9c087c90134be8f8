"""jax-pmap's sharded layouts (ZeRO stages 1-3 / FSDP) with explicit collectives.

Every device of every process (``N = jax.device_count()``, process-major: a process's devices
hold consecutive shards) keeps shard ``axis_index`` of each unit's flat buffer
(``adapters._jax.flat_units.FlatUnits``), stacked on the leading axis pmap maps over:

- stage 1: full parameters on every device; the gradient averaged in full (``lax.pmean``) and
  kept; each device updates its slice of the parameters with its shard of the optimizer state;
  the updated slices are re-assembled with ``lax.all_gather``.
- stage 2: as 1, but the gradient is reduce-scattered (``lax.psum_scatter``, a sum, divided by
  ``N`` for the data-parallel mean): each device only ever holds its gradient shard.
- stage 3 (FSDP): only shards are held. Each unit's forward runs inside ``jax.checkpoint`` as
  "all-gather the unit's shard, then the unit's forward": the gathered parameters are freed
  after the unit's forward, and the backward gathers them again before the transpose of the
  all-gather, a ``psum_scatter``, reduce-scatters the unit's gradient. The unit's matrix
  products are kept for the backward (``dots_saveable``: only the elementwise operations
  between them run again), or, with ``activation_checkpointing``, recomputed too. Gradient
  accumulation reduce-scatters every micro-batch's gradient (accumulating unsharded
  gradients would need full-size buffers).
  A spec model runs unit by unit (``adapters._jax.flat_units.unit_forward``); a native Flax
  module has no such units, so its forward is one: every unit gathered before it, freed
  after, gathered again for the backward (FSDP wrapping only the root module). Under mixed
  precision a shard is cast to
  the compute dtype before its all-gather (half the bytes in bfloat16, FSDP2's
  ``param_dtype``), and the gather's transpose reduce-scatters the gradient in float32
  (``reduce_dtype``): :func:`compute_gather`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from adapters._jax.flat_units import (
    FlatUnits,
    check_layout,
    nbytes,
    state_head,
    unit_forward,
    unit_named,
)
from adapters._jax.native_optax import ShardedOptax, check_sharded, check_sharded_optimizer
from adapters._jax.update import apply_optimizer, squares, update
from adapters.jax_pmap.data_parallel import PmapDataParallel
from toolkit import ToolkitError
from toolkit.models.reference import optimizer_slots

AXIS = "batch"


def compute_gather(jax, axis: str, dtype, shard_dtype, groups=None):
    """``shard -> the whole flat buffer`` over ``axis`` (within ``groups``: lists of device
    indices, None for all); with a compute ``dtype``, the shard (of ``shard_dtype``) is cast
    before the all-gather, which then carries ``dtype``'s bytes, and the backward
    reduce-scatters the gradient in ``shard_dtype``. Bit for bit what a float32 gather
    followed by a cast computes (a cast is elementwise, and its transpose casts back before
    the float32 reduce-scatter), in fewer bytes."""
    lax = jax.lax
    if dtype is None:
        return lambda shard: lax.all_gather(shard, axis, tiled=True, axis_index_groups=groups)

    @jax.custom_vjp
    def gather(shard):
        return lax.all_gather(shard.astype(dtype), axis, tiled=True, axis_index_groups=groups)

    def forward(shard):
        return gather(shard), None

    def backward(_, g):
        return (lax.psum_scatter(g.astype(shard_dtype), axis, tiled=True,
                                 axis_index_groups=groups),)

    gather.defvjp(forward, backward)
    return gather


class PmapSharded(PmapDataParallel):
    """``toolkit.Sharded(stage)`` for ``jax-pmap``: the data-parallel strategy with
    its hooks (``_build_layout``, ``_keep``, ``_full_params``) and state methods replaced."""

    composes = ("replicate",)  # HSDP: shards within groups of devices (axis_index_groups)

    @staticmethod
    def check_layout(layout) -> None:
        check_layout("jax-pmap", layout)

    def _build_layout(self, model, optimizer, loss, seed, accumulation_steps, metrics):
        jax, lax = self.jax, self.jax.lax
        check_sharded_optimizer(self.name, optimizer)
        params, _, model_state = self._build_common(model, optimizer, loss, seed,
                                                    accumulation_steps, metrics, init_opt=False)
        stage = self.layout.dims.zero
        self.spec = model
        # HSDP: the devices of a replica shard the state among themselves (the collectives'
        # axis_index_groups), and each shard is averaged across the replicas
        grid = self.layout.dims.grid(jax.device_count())
        shards = grid.extent("data")
        self.groups, self.replica_groups = (
            (None, None) if grid.extent("replicate") == 1 else
            ([list(g) for g in grid.groups("data")], [list(g) for g in grid.groups("replicate")]))
        self.units = FlatUnits(self.model, shards)
        # The global index of each local device (the position pmap gives it).
        where = np.asarray(jax.pmap(lambda _: lax.axis_index(AXIS), axis_name=AXIS)(
            np.zeros(len(self.devices))))
        self.first = int(where[0])
        # (its shard in its replica's group, and whether that replica writes the pieces)
        self.first_shard, self.writes = self.first % shards, self.first < shards
        if not np.array_equal(where, self.first + np.arange(len(where))) or \
                self.first_shard + len(where) > shards:
            raise ToolkitError(f"jax-pmap: this process's devices are shards {where.tolist()}",
                               "they must be consecutive (one process's devices together, "
                               "inside one replica)")
        host = self.units.flatten(self.model.flat(params))
        self.params = self._place_flat(host, whole=stage < 3)
        zeros = {u: np.zeros_like(a) for u, a in host.items()}
        self.optax = None  # a native optax state's conversions (ShardedOptax)
        if self.opt_spec is None:
            check_sharded(self.name, self.layout, self.tx, self.model)
            self.optax = ShardedOptax(self.model, host, self._local, self._replicate)
            self.opt_state = jax.pmap(self.tx.init)(self._place_flat(host, whole=False))
        else:
            self.opt_state = {slot: self._place_flat(zeros, whole=False)
                              for slot in optimizer_slots(optimizer)}
        self.grads = self._place_flat(zeros, whole=stage == 1)  # replaced by each step's
        self.model_state = self._replicate(model_state)
        self._pstep = jax.pmap(self._sharded_device_step, axis_name=AXIS,
                               in_axes=(0, 0, 0, 0, 0, self._unmapped_scalars(), None),
                               donate_argnums=(0, 1, 2))
        self._pgather = jax.pmap(
            lambda t: jax.tree_util.tree_map(lambda s: lax.all_gather(
                s, AXIS, tiled=True, axis_index_groups=self.groups), t), axis_name=AXIS)
        self._jeval = jax.jit(self._eval_fn)

    def _place_flat(self, host: dict[str, np.ndarray], whole: bool) -> dict[str, Any]:
        """Flat buffers on the local devices: whole on each, or each device its shard."""
        n = len(self.devices)
        out = {}
        for unit, flat in host.items():
            size = self.units.layouts[unit].shard_size
            first = self.first_shard
            stacked = (np.stack([flat] * n) if whole else
                       flat[first * size:(first + n) * size].reshape(n, size))
            out[unit] = self.jax.device_put(stacked, self.stacked)
        return out

    # ------------------------------------------------------------------ inside pmap
    def _flat_forward(self, flat, model_state, xb, rng):
        tree = self.model.unflat(self.units.named(flat), self.model.params)
        return self.model.apply(tree, model_state, xb, train=True, rng=rng)

    def _fsdp_forward(self, shards, model_state, xb, rng):
        jax, layouts = self.jax, self.units.layouts
        names = list(layouts)
        tied_extra = self.model.gpt is not None and self.spec.tied

        gather = compute_gather(jax, AXIS, self.precision.compute, self.dtype, self.groups)

        # the backward gathers each unit again; without activation checkpointing it keeps the
        # unit's matrix products and recomputes only the elementwise operations between them
        policy = None if self.recompute else jax.checkpoint_policies.dots_saveable
        if self.model.native:  # one unit of computation: the whole module (FSDP's root)
            def whole(shards, model_state, xb, rng):
                return self._flat_forward({u: gather(s) for u, s in shards.items()},
                                          model_state, xb, rng)

            return jax.checkpoint(whole, policy=policy)(shards, model_state, xb, rng)

        def unit_call(unit: str, with_embedding: bool):
            def run(shard, h, embedding_shard):
                # gathered here and freed after; jax.checkpoint gathers again for the backward
                named = unit_named(layouts[unit], gather(shard))
                if with_embedding:
                    named["tok_emb"] = unit_named(layouts[names[0]],
                                                  gather(embedding_shard))["tok_emb"]
                return unit_forward(self.spec, unit, self.precision.in_compute(named), h)

            return jax.checkpoint(run, policy=policy)

        h = xb
        for i, unit in enumerate(names):
            extra = tied_extra and i == len(names) - 1 and i > 0
            h = unit_call(unit, extra)(shards[unit], h, shards[names[0]] if extra else None)
        return h, model_state

    def _sharded_device_step(self, params, opt_state, model_state, x, y, scalars, seed):
        jax, lax, n = self.jax, self.jax.lax, self.units.shards
        tmap = jax.tree_util.tree_map
        key = jax.random.fold_in(jax.random.PRNGKey(seed), lax.axis_index(AXIS))
        index = lax.axis_index(AXIS) % n  # this device's shard (in its replica's group)
        groups = self.groups
        stage = self.layout.dims.zero
        forward = self._fsdp_forward if stage == 3 else self._flat_forward
        before = (params, opt_state, model_state)
        scale = self.loss_scale(scalars)
        grads, losses, new_state = self._accumulated_grads(params, model_state, x, y, key,
                                                           forward=forward, scale=scale,
                                                           cast_params=stage < 3)
        new_state = lax.pmean(new_state, AXIS)

        def mine(full, unit):  # this device's slice of a full flat buffer
            size = self.units.layouts[unit].shard_size
            return lax.dynamic_slice_in_dim(full, index * size, size)

        jnp = self.jnp
        if stage == 3:  # the all-gathers' transposes summed the group's gradients
            grads = tmap(lambda g: g / n, grads)
        elif stage == 1:  # the full gradient on every device
            grads = lax.pmean(grads, AXIS)
        else:  # each device's shard (zero padding)
            grads = tmap(lambda g: lax.psum_scatter(g, AXIS, tiled=True,
                                                    axis_index_groups=groups) / n, grads)
        if stage > 1 and self.replica_groups is not None:  # (HSDP: across the replicas)
            grads = lax.pmean(grads, AXIS, axis_index_groups=self.replica_groups)

        def sum_squares(g):  # stage 1: every device holds the whole gradient; 2, 3: a shard
            sq = squares(jnp, g)
            return sq if stage == 1 else lax.psum(sq, AXIS, axis_index_groups=groups)

        def apply(g):  # stage 3 updates its own shards; 1 and 2 gather the updated ones
            if stage == 3:
                return (*apply_optimizer(self.rule, self.tx, g, opt_state, params, scalars),
                        new_state)
            shard = {u: mine(a, u) for u, a in g.items()} if stage == 1 else g
            updated, opt = apply_optimizer(self.rule, self.tx, shard, opt_state,
                                           {u: mine(p, u) for u, p in params.items()}, scalars)
            return tmap(lambda s: lax.all_gather(s, AXIS, tiled=True, axis_index_groups=groups),
                        updated), opt, new_state

        (params, opt_state, model_state), norm = update(jnp, self.rule, grads, sum_squares,
                                                        apply, before, scalars)
        return params, opt_state, model_state, self.jnp.mean(losses), grads, norm

    # ------------------------------------------------------------------ host side
    def _gathered(self, flat: dict[str, Any], whole: bool) -> dict[str, np.ndarray]:
        """Full flat buffers on the host (a collective when sharded: every process calls)."""
        if not whole:
            flat = self._pgather(flat)
        return {u: np.asarray(a[0]) for u, a in flat.items()}

    def _tree(self, flat: dict[str, Any], whole: bool):
        return self.model.unflat(self.units.named(self._gathered(flat, whole)),
                                 self.model.params)

    def _full_params(self):
        return self._tree(self.params, self.layout.dims.zero < 3)

    def _keep(self, out) -> None:
        self.grads = out[4]  # the gradient this layout keeps (memory_bytes counts it)

    def state_dict(self) -> dict[str, np.ndarray]:
        if self.optax is not None:
            opt = self.optax.to_tree(self.opt_state,
                                     lambda s: self.units.named(self._gathered(s, False)))
        else:
            opt = {slot: self._tree(s, False) for slot, s in self.opt_state.items()}
        return self._export(self._full_params(), opt, self._local(self.model_state))

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        like = self.model.params
        params, opt_state, model_state = self._import(
            state, like, self.optax.like(self.opt_state) if self.optax is not None else
            {slot: like for slot in self.opt_state}, self._local(self.model_state))
        flatten = self.units.flatten
        self.params = self._place_flat(flatten(self.model.flat(params)),
                                       whole=self.layout.dims.zero < 3)
        if self.optax is not None:
            self.opt_state = self.optax.from_tree(
                opt_state, lambda named: self._place_flat(flatten(named), whole=False))
        else:
            self.opt_state = {slot: self._place_flat(flatten(self.model.flat(t)), whole=False)
                              for slot, t in opt_state.items()}
        self.model_state = self._replicate(model_state)

    def sharded_state(self):
        """``(replicated, pieces)`` (see :class:`toolkit.ShardedAdapter`): this process's
        devices' consecutive shards of each unit, cut into pieces by ``FlatLayout.owned``."""
        replicated, stores = state_head(
            self, self._local(self.model_state),
            lambda: self.units.named(self._gathered(self.params, True)))
        pieces = {}
        for key, store in stores:
            for unit, stacked in store.items():
                lo = self.first_shard * self.units.layouts[unit].shard_size
                data = np.asarray(stacked).reshape(-1)
                # (HSDP: the first replica writes; the others' pieces are empty)
                pieces.update(self.units.pieces(unit, lo, data if self.writes else data[:0],
                                                key))
        return replicated, pieces

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of this process's device buffers (every local device's, so a replicated
        buffer counts once per local device): parameters, the kept gradient,
        optimizer slots."""
        params = nbytes(self.params)
        return {"params": params, "grads": nbytes(self.grads),
                "optimizer": nbytes(self.opt_state)}
