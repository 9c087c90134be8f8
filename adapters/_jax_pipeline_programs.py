"""The per-device programs of one JAX pipeline step, shared by jax-pjit and jax-pmap.

``StagePrograms`` holds the bodies one device runs for its stage (no leading device axes):
``prepare`` (the local inputs cut into micro-batches), ``compute`` (the round's action through
``lax.switch``: idle, or the forward or backward of one piece), ``exchange`` (one wave of
activations forward and gradients backward between neighbouring stages) and ``update`` (the
gradient summed over the stage's replicas, the tied embedding's over its holder stages, the
elementwise optimizer). The collectives come from a *mechanism* object, so the same bodies run
under ``shard_map`` over a ``(stage, data)`` mesh (``adapters/_jax_pipeline_pjit.py``) and under
``pmap`` over one device axis (``adapters/_jax_pipeline_pmap.py``). A mechanism has:

- ``stage()``: this device's stage (traced);
- ``replica_sum(x)``: the sum over the ``D`` replicas of this device's stage;
- ``holder_sum(x)``: the sum over the ``S`` stages of this device's replica;
- ``total(x)``: the sum over every device;
- ``shift(x, pairs)``: ``x`` moved from stage ``a`` to stage ``b`` for each ``(a, b)`` (within
  each replica; a device that receives nothing gets zeros);
- ``gather_replica(x)``: the replica's ``S`` devices' ``x`` concatenated in stage order.

The host side both executors share is ``adapters/_jax_pipeline_executor.py``.
"""

from __future__ import annotations

import numpy as np

from adapters._flax_models import per_sample_loss
from adapters._jax import apply_optimizer


class StagePrograms:
    """The per-device bodies of one step (see the module docstring).

    Args:
        jax: the module. staged: the ``StagedModel``. loss_fn: the loss. tx: the optimizer.
        coll: the mechanism's collectives. micro_batches: ``M``. mb: samples per micro-batch.
        inv_b: ``1 / global batch`` (each backward scales by it). gather: the replica's batch is
        its ``S`` devices' inputs gathered (``gather_replica``), else each device's own.
        x_struct: one micro-batch of inputs (``jax.ShapeDtypeStruct``). dtype: the parameters'.
    """

    def __init__(self, jax, staged, loss_fn, tx, coll, micro_batches: int, mb: int,
                 inv_b: float, gather: bool, x_struct, dtype):
        self.jax, self.jnp, self.lax = jax, jax.numpy, jax.lax
        self.staged, self.loss_fn, self.tx, self.coll = staged, loss_fn, tx, coll
        self.M, self.mb, self.inv_b, self.gather = micro_batches, mb, inv_b, gather
        # Per-sample activation shapes at every cut, from the pieces themselves.
        self.shapes, h = [], x_struct
        for k in range(staged.pieces):
            p = {nm: jax.ShapeDtypeStruct(np.shape(staged.init[nm]), dtype)
                 for nm in staged.piece_names[k]}
            h = jax.eval_shape(staged.fns[k], p, h)
            self.shapes.append(h)
        self.width = max([int(np.prod(s.shape[1:])) for s in self.shapes[:-1]] or [1])
        K = staged.pieces
        self.branches = [self._idle] + [f for k in range(K)
                                        for f in (self._forward(k), self._backward(k))]
        cyclic = staged.chunks > 1  # the last stage's chunk feeds stage 0's next chunk
        S = staged.stages
        self.fwd = [(s, (s + 1) % S) for s in range(S if cyclic else S - 1)]
        self.bwd = [(b, a) for a, b in self.fwd]

    def box_shape(self, slots: int) -> tuple[int, ...]:
        return (slots, self.mb, self.width)

    def prepare(self, x):
        whole = self.coll.gather_replica(x) if self.gather else x
        return whole.reshape((self.M, self.mb) + x.shape[1:])

    def _pack(self, h):
        flat = h.reshape(self.mb, -1)
        return self.jnp.pad(flat, ((0, 0), (0, self.width - flat.shape[1])))

    def _unpack(self, row, k):  # the input of piece k (the output of piece k - 1)
        like = self.shapes[k - 1]
        return row[:, :int(np.prod(like.shape[1:]))].reshape(like.shape).astype(like.dtype)

    def _forward(self, k: int):
        staged, jnp, last = self.staged, self.jnp, k == self.staged.pieces - 1

        def run(p, g, bx, ls, x, y, m, a_in, g_in, out):
            h = x[m] if k == 0 else self._unpack(bx[a_in], k)
            o = staged.fns[k](staged.piece_params(p, k), h)
            if last:
                return g, bx, ls.at[m].set(per_sample_loss(jnp, self.loss_fn, o, y[m]))
            return g, bx.at[out].set(self._pack(o)), ls
        return run

    def _backward(self, k: int):
        staged, jnp, jax, last = self.staged, self.jnp, self.jax, k == self.staged.pieces - 1

        def run(p, g, bx, ls, x, y, m, a_in, g_in, out):
            params = staged.piece_params(p, k)
            h = x[m] if k == 0 else self._unpack(bx[a_in], k)
            if last:
                def objective(pp, hh):
                    return jnp.sum(per_sample_loss(jnp, self.loss_fn, staged.fns[k](pp, hh),
                                                   y[m])) * self.inv_b
                gp, gh = jax.grad(objective, argnums=(0, 1), allow_int=True)(params, h)
            else:
                _, vjp = jax.vjp(staged.fns[k], params, h)
                gp, gh = vjp(self._unpack(bx[g_in], k + 1).astype(self.shapes[k].dtype))
            g = staged.add_grads(g, k, gp)
            return g, (bx if k == 0 else bx.at[out].set(self._pack(gh))), ls
        return run

    @staticmethod
    def _idle(p, g, bx, ls, x, y, m, a_in, g_in, out):
        return g, bx, ls

    def compute(self, p, g, bx, ls, x, y, c):
        """The round's action: ``c`` is the stage's ``[branch, micro_batch, act_in, grad_in,
        out]`` row (``adapters._jax_pipeline.Round``)."""
        return self.lax.switch(c[0], self.branches, p, g, bx, ls, x, y, c[1], c[2], c[3], c[4])

    def exchange(self, forward: bool, backward: bool):
        """One wave: ``c`` is the stage's ``[send_f, send_b, recv_f, valid, recv_b, valid]``."""
        jnp = self.jnp

        def run(bx, c):
            sent_f, sent_b = bx[c[0]], bx[c[1]]  # read before any receive writes
            if forward:
                got = self.coll.shift(sent_f, self.fwd)
                bx = bx.at[c[2]].set(jnp.where(c[3] > 0, got, bx[c[2]]))
            if backward:
                got = self.coll.shift(sent_b, self.bwd)
                bx = bx.at[c[4]].set(jnp.where(c[5] > 0, got, bx[c[4]]))
            return bx
        return run

    def update(self, p, opt, g, ls, scalars):
        """``(params, opt, zeroed grads, the global batch's mean loss)``."""
        jnp, coll, shared = self.jnp, self.coll, self.staged.n_shared
        g = coll.replica_sum(g)
        if shared:  # the tied embedding: first and last stage add their gradients
            holder = jnp.asarray(self.staged.holders_mask().astype(g.dtype))[coll.stage()]
            total = coll.holder_sum(g[:shared] * holder)
            g = g.at[:shared].set(jnp.where(holder > 0, total, g[:shared]))
        p, opt = apply_optimizer(self.tx, g, opt, p, scalars)
        return p, opt, jnp.zeros_like(g), coll.total(jnp.sum(ls)) * self.inv_b
