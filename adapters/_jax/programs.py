"""The per-device programs of one JAX pipeline step, shared by jax-pjit and jax-pmap.

``StagePrograms`` holds the bodies one device runs for its stage (no leading device axes):
``prepare`` (the local inputs cut into micro-batches), ``branches`` (the forward or backward
of one piece), ``exchange`` (one wave of activations forward and gradients backward between
neighbouring stages) and ``update`` (the gradient summed over the stage's replicas, the tied
embedding's over its holder stages, the elementwise optimizer: a spec's, or the user's optax
transformation on the stage's flat vector; the model state the step's forwards moved averaged
over the stage's replicas). The collectives come from a
*mechanism* object, so the same bodies run under ``shard_map`` over a ``(stage, data)`` mesh
(``adapters/jax_pjit/pipeline.py``) and under ``pmap`` over one device axis
(``adapters/jax_pmap/pipeline.py``). The branches take no collective: ``LocalComputes`` runs
each on one device, as that process's own program. A mechanism has:

- ``stage()``: this device's stage (traced);
- ``replica_sum(x)``: the sum over the ``D`` replicas of this device's stage;
- ``holder_sum(x)``: the sum over the ``S`` stages of this device's replica;
- ``total(x)``: the sum over every device;
- ``shift(x, pairs)``: ``x`` moved from stage ``a`` to stage ``b`` for each ``(a, b)`` (within
  each replica; a device that receives nothing gets zeros);
- ``gather_replica(x)``: the replica's ``S`` devices' ``x`` concatenated in stage order.

Model state (BatchNorm statistics, ``stages.StagedModel``'s state vectors): each device holds
its stage's flat state vector. A piece's training forward reads its layers' entries and writes
back the updated ones, so a stage's micro-batches move the statistics in the order the stage
runs their forwards (0, 1, ..., M - 1, as data parallelism's accumulation steps do); a
backward runs the piece again with the state its forward saw (kept with the forward's
activations) and changes none. The update averages the moved state over the stage's ``D``
replicas (jax-pmap's data parallelism averages ``batch_stats`` over its devices each step), or
keeps the step's old state when the step is skipped.

Dropout: micro-batch ``m`` of replica ``d`` draws from ``fold_in(PRNGKey(seed), m)`` with one
replica (``D = 1``: jax-pjit's data parallelism over the global batch with ``M`` accumulation
steps draws these keys) and from ``fold_in(fold_in(PRNGKey(seed), d), m)`` with more (jax-pmap's
over ``D`` devices), ``seed`` the step's (``adapters._common.step_seed``). The same
``D``/``M`` correspondence holds for the batch statistics: with one replica they are those of
jax-pjit's accumulation steps (one micro-batch of the global batch each), with ``D`` those of
jax-pmap's devices, averaged after the step.

The host side both executors share is ``adapters/_jax/pipeline.py``.
"""

from __future__ import annotations

import numpy as np

from adapters._jax.models.spec import per_sample_loss
from adapters._jax.residuals import Residuals
from adapters._jax.stages import computing
from adapters._jax.update import apply_optimizer, update


class StagePrograms:
    """The per-device bodies of one step (see the module docstring).

    Args:
        jax: the module. staged: the ``StagedModel``. loss_fn: the loss. tx: the optimizer.
        coll: the mechanism's collectives. micro_batches: ``M``. mb: samples per micro-batch.
        inv_b: ``1 / global batch`` (each backward scales by it). gather: the replica's batch is
        its ``S`` devices' inputs gathered (``gather_replica``), else each device's own.
        x_struct: one micro-batch of inputs (``jax.ShapeDtypeStruct``). dtype: the parameters'.
        rule: the update rule (``adapters._update.UpdateRule``: ``clip_grad_norm`` and
            ``skip_nonfinite``).
        compute: a mixed-precision policy's compute dtype (None: the parameters'): each piece
            runs in it (``stages.computing``), the loss in ``dtype``. The box (:attr:`box_dtype`)
            is in the compute dtype when every activation between pieces is: the exchanges then
            move 16-bit values, half the bytes; else in ``dtype``, which holds a 16-bit value
            exactly.
        recompute: each piece's backward runs its forward again (activation checkpointing);
            else its forward hands the backward the activations it needs
            (``adapters._jax.residuals``), held per micro-batch in flight.
        replicas: ``D``, each stage's replicas (the dropout keys and the model state: the
            module docstring).
    """

    def __init__(self, jax, staged, loss_fn, tx, coll, micro_batches: int, mb: int,
                 inv_b: float, gather: bool, x_struct, dtype, rule, precision,
                 recompute: bool = True, replicas: int = 1):
        self.jax, self.jnp, self.lax = jax, jax.numpy, jax.lax
        self.staged, self.loss_fn, self.tx, self.coll = staged, loss_fn, tx, coll
        self.M, self.mb, self.inv_b, self.gather = micro_batches, mb, inv_b, gather
        self.rule, self.dtype, self.precision = rule, dtype, precision
        compute = precision.compute
        self.fns = [computing(fn, compute) for fn in staged.fns]
        self.residuals = Residuals(jax, recompute)
        self.replicas = replicas  # D: the dropout keys' and the state's rule (above)
        # The tied parameter counts once in the norm: on the first stage holding it.
        holders = sorted({s for stages in staged.shared.values() for s in stages})
        self.repeats = np.asarray([1.0 if s in holders[1:] else 0.0
                                   for s in range(staged.stages)])
        # Per-sample activation shapes at every cut, from the pieces themselves.
        self.shapes, h = [], x_struct
        key = jax.ShapeDtypeStruct((2,), np.uint32)
        for k in range(staged.pieces):
            p = {nm: jax.ShapeDtypeStruct(np.shape(staged.init[nm]), dtype)
                 for nm in staged.piece_names[k]}
            st = {nm: jax.ShapeDtypeStruct(np.shape(staged.state_init[nm]), dtype)
                  for nm in staged.state_names[k]}
            h, _ = jax.eval_shape(self.fns[k], p, h, st, key)
            self.shapes.append(h)
        self.width = max([int(np.prod(s.shape[1:])) for s in self.shapes[:-1]] or [1])
        cuts = {np.dtype(s.dtype) for s in self.shapes[:-1]}
        self.box_dtype = cuts.pop() if compute is not None and cuts == {np.dtype(compute)} \
            else np.dtype(dtype)
        K = staged.pieces
        # Branch 0 is idle (nothing runs); 1 + 2k and 2 + 2k are piece k's forward, backward.
        self.branches = [None] + [f for k in range(K)
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

    def _piece(self, k: int):
        """``(f, rest)``: piece ``k`` as ``f(params, h, state, key, *rest) -> (output, new
        state)`` (the last piece's output is its per-sample losses, ``rest`` its labels)."""
        if k < self.staged.pieces - 1:
            return self.fns[k], lambda y, m: ()

        def losses(pp, hh, state, key, labels):
            out, state = self.fns[k](pp, hh, state, key)
            return per_sample_loss(self.jnp, self.loss_fn, out.astype(self.dtype),
                                   labels), state
        return losses, lambda y, m: (y[m],)

    def _key(self, m, seed, replica):
        """Micro-batch ``m``'s dropout key on ``replica`` this step (the module docstring's
        rule); ``seed``: the step's seed, its uint32 bits in an int32."""
        jax = self.jax
        key = jax.random.PRNGKey(self.lax.bitcast_convert_type(seed, self.jnp.uint32))
        if self.replicas > 1:
            key = jax.random.fold_in(key, replica)
        return jax.random.fold_in(key, m)

    def _forward(self, k: int):
        staged, last = self.staged, k == self.staged.pieces - 1
        f, rest = self._piece(k)

        def run(p, g, bx, ls, x, y, st, kept, m, a_in, g_in, out, scale_exp, seed, replica):
            h = x[m] if k == 0 else self._unpack(bx[a_in], k)
            params, state = staged.piece_params(p, k), staged.piece_state(st, k)
            o, moved, kept = self.residuals.forward(k, f, params, h, state,
                                                    self._key(m, seed, replica), *rest(y, m))
            # the state this forward saw goes with its activations to its backward
            kept = [*kept, *(state[n] for n in staged.state_names[k])]
            st = staged.with_state(st, k, moved)
            if last:
                return g, bx, ls.at[m].set(o), st, kept
            return g, bx.at[out].set(self._pack(o)), ls, st, kept
        return run

    def _backward(self, k: int):
        staged, jnp, last = self.staged, self.jnp, k == self.staged.pieces - 1
        f, rest = self._piece(k)
        n_state = len(staged.state_names[k])

        def run(p, g, bx, ls, x, y, st, kept, m, a_in, g_in, out, scale_exp, seed, replica):
            params = staged.piece_params(p, k)
            kept, seen = kept[:len(kept) - n_state], kept[len(kept) - n_state:]
            state = dict(zip(staged.state_names[k], seen, strict=True))
            h = x[m] if k == 0 else self._unpack(bx[a_in], k)
            if last:  # d(the mean loss, fp16: scaled by 2 ** scale_exp) / d(each loss)
                one = jnp.asarray(self.inv_b, self.dtype)
                scale = jnp.ldexp(jnp.ones((), self.dtype), scale_exp)  # (exactly 2 ** exp)
                ct = jnp.full(ls[m].shape, self.precision.scale_loss(one, scale))
            else:
                ct = self._unpack(bx[g_in], k + 1).astype(self.shapes[k].dtype)
            gp, gh = self.residuals.backward(
                k, f, params, h, (state, self._key(m, seed, replica), *rest(y, m)), kept, ct)
            g = staged.add_grads(g, k, gp)
            return g, (bx if k == 0 else bx.at[out].set(self._pack(gh))), ls, st, []
        return run

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

    def update(self, p, opt, g, ls, scalars, old, moved):
        """``(params, opt, zeroed grads, the global batch's mean loss, the gradient's norm
        before clipping, the model state)``: ``old`` is the stage's state before the step,
        ``moved`` after its forwards (this replica's); the new state is ``moved`` averaged
        over the stage's replicas, or ``old`` when the step is skipped."""
        jnp, coll, shared = self.jnp, self.coll, self.staged.n_shared
        if self.staged.has_state and self.replicas > 1:
            moved = coll.replica_sum(moved) / self.replicas
        g = coll.replica_sum(g)
        if shared:  # the tied embedding: first and last stage add their gradients
            holder = jnp.asarray(self.staged.holders_mask().astype(g.dtype))[coll.stage()]
            total = coll.holder_sum(g[:shared] * holder)
            g = g.at[:shared].set(jnp.where(holder > 0, total, g[:shared]))

        def squares(g):  # over the stages of a replica (every replica holds the same)
            sq = jnp.sum(jnp.square(g))
            if shared:  # the tied embedding once: on the first stage holding it
                repeat = jnp.asarray(self.repeats.astype(g.dtype))[coll.stage()]
                sq = sq - repeat * jnp.sum(jnp.square(g[:shared]))
            return coll.holder_sum(sq)

        (p, opt, state), norm = update(
            jnp, self.rule, g, squares,
            lambda g: (*apply_optimizer(self.rule, self.tx, g, opt, p, scalars), moved),
            (p, opt, old), scalars)
        return p, opt, jnp.zeros_like(g), coll.total(jnp.sum(ls)) * self.inv_b, norm, state


class LocalComputes:
    """A round's computes, one jitted program per ``(action branch, local device)``, run on the
    device's own blocks of the global arrays. The computes take no collective, so each process
    runs only its own devices' programs, dispatched asynchronously.

    Measured at ``benchmarks/pipeline_bubble.py``'s MLP (S = 2, M = 8, one core per stage): a
    forward 48 -> 20 ms, a backward 105-110 -> 57 ms, against one SPMD program per round whose
    ``lax.switch`` over every branch copied the stage's gradient vector and box into and out of
    the conditional on every call (about 40 MB), with the parameters sliced out of the flat
    vector by every action and the gradients added one parameter at a time.

    ``run(row_of, blocks)``: ``row_of(device)`` is the round's ``[branch, micro_batch, act_in,
    grad_in, out]`` row of the device's stage, the step's loss scale exponent (fp16: the
    scale is a power of two; else 0), the step's seed (its uint32 bits) and the device's
    replica; ``blocks[device]`` holds its ``[params (by name, :meth:`params`), grads, box,
    losses, inputs, labels, model state]`` blocks (leading axes of length 1 as the global
    arrays give them); the grads, box, losses and state are replaced by the results.
    Returns the devices that ran something. What a forward keeps for its micro-batch's
    backward (``StagePrograms``' ``recompute``) waits in :attr:`kept` until that backward;
    :attr:`peak_kept` is the most bytes it held at once on this process's devices."""

    def __init__(self, jax, programs: StagePrograms):
        self.jax, self.programs, self.cache, self.slicers = jax, programs, {}, {}
        self.kept: dict[tuple, list] = {}  # (device, piece, micro-batch) -> the forward's
        self.held = self.peak_kept = 0  # bytes in ``kept`` now, and at most

    def params(self, stage: int, block):
        """The stage's parameters by name from its flat block, sliced once per step: sliced
        by each action instead, the copies cost 3-6 ms a forward (measured)."""
        if stage not in self.slicers:
            self.slicers[stage] = self.jax.jit(
                lambda p: self.programs.staged.stage_params(p, stage))
        return self.slicers[stage](block)

    def compile(self, branch: int, device, blocks: list) -> None:
        """Compiles the program of ``branch`` on ``device`` ahead, for ``blocks`` like these
        (a backward, for what its piece's forward keeps)."""
        jax, ctrl, home = self.jax, np.zeros(8, np.int32), blocks[1].sharding  # (the device's)

        def struct(b, sharding=None):
            return jax.ShapeDtypeStruct(b.shape, b.dtype, sharding=sharding or b.sharding)
        blocks = jax.tree_util.tree_map(struct, blocks)
        kept = [] if branch % 2 else jax.tree_util.tree_map(
            lambda b: struct(b, home), jax.eval_shape(self._jit(branch - 1), *blocks, [], ctrl)[4])
        self.cache[branch, device] = self._jit(branch).lower(*blocks, kept, ctrl).compile()

    def _jit(self, branch: int):
        body = self.programs.branches[branch]

        def run(p, g, bx, ls, x, y, st, kept, c):
            lead = g.ndim - 1  # the flat gradient's leading axes of length 1

            def core(a):
                return a.reshape(a.shape[lead:])
            # The gradient keeps its leading axes: reshaped, it was copied whole by XLA.
            *out, kept = body(p, g, core(bx), core(ls), core(x), core(y), core(st), kept, c[1],
                              c[2], c[3], c[4], c[5], c[6], c[7])
            return (*(o.reshape(i.shape) for o, i in zip(out, (g, bx, ls, st), strict=True)),
                    kept)
        # (the state is not donated: its first block each step is the step's old state, which
        # the update keeps when the step is skipped)
        return self.jax.jit(run, donate_argnums=(1, 2, 3))

    def run(self, row_of, blocks: dict) -> list:
        ran = []
        for device, b in blocks.items():
            row = row_of(device)
            if row[0]:  # 0: idle; odd: a piece's forward, even: its backward
                key = (device, (int(row[0]) - 1) // 2, int(row[1]))
                kept = [] if row[0] % 2 else self.kept.pop(key, [])
                self.held -= sum(a.nbytes for a in kept)
                b[1], b[2], b[3], b[6], kept = self.cache[int(row[0]), device](*b, kept, row)
                if kept:
                    self.kept[key] = kept
                    self.held += sum(a.nbytes for a in kept)
                    self.peak_kept = max(self.peak_kept, self.held)
                ran.append(device)
        return ran
