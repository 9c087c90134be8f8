"""Sharded parameters (ZeRO stages 1-3 / FSDP) for the ``horovod-tf`` backend.

The mechanism, with ``horovod.tensorflow``'s core ops inside the compiled step (``tf.function``);
the semantics (units, flat padded shards, checkpoint pieces) are ``toolkit.parallel.shards``':

- Every unit of ``toolkit.parallel.shards.unit_layouts`` (an MLP's ``layers.i``, a CNN's
  ``convs.i``, a GPT's ``blocks.i`` with the embeddings in the first and ``ln_f``/``head`` in
  the last) is one flat buffer padded to a multiple of the world size N; rank r owns elements [r*L,
  (r+1)*L).
  Every collective below moves whole padded buffers, so Horovod's uneven split of a first
  dimension (the first ``dim0 % N`` ranks get one row more) never arises.
- Stage 1: each rank keeps the optimizer slots of its shard only. The local gradient of a unit
  is flattened and averaged in full (``hvd.allreduce``) into a persistent full-size gradient
  buffer; each rank updates its shard of the parameters with ``toolkit.models.reference``'s
  arithmetic (``update.spec_update``, as data parallel) and the updated shards are
  re-assembled with ``hvd.allgather``.
- Stage 2: as 1, but the flat gradient is ``hvd.reducescatter(op=hvd.Average)``-ed: each rank
  keeps only its gradient shard (in a persistent buffer, so its size is real and measured).
- Stage 3 (FSDP): the parameters live only as shards. Each unit's forward is one
  ``tf.custom_gradient`` function of (its input activation, its shards): it all-gathers the
  shards (once the previous unit's output exists: no prefetch) and runs the unit; its gradient
  function reduce-scatters (average over ranks: the data-parallel mean) the gradient of the
  gathered buffer into the shard's gradient. By default (``activation_checkpointing`` None or
  True) the forward drops the gathered buffer, so one unit's parameters are gathered at a time,
  and the gradient function gathers it again once the backward pass reaches the unit (the
  gather depends on the incoming gradient, so it cannot run early) and recomputes the unit's
  forward under a ``tf.GradientTape``: FSDP with per-unit activation checkpointing, only the
  units' input activations kept between forward and backward. (Not ``tf.recompute_grad``: in a
  graph its recomputation has no data dependency on the backward and may be scheduled during
  the forward, keeping gathered parameters alive.) With ``activation_checkpointing=False`` the
  forward runs under the tape and the gradient function takes it: no second gather and no
  recomputation, but the tape keeps the unit's activations and its gathered buffer until the
  unit's backward (FSDP2's ``reshard_after_forward=False``). Horovod's own ``allgather``
  gradient (a full allreduce, then a slice) is never used.

Accumulation: stages 1/2 sum the micro-batches' gradients locally and reduce once per step. In
stage 3 every micro-batch's backward reduce-scatters its gradient (FSDP's default: summing full
gradients locally would need the full-size gradient buffers stage 3 exists to avoid); the
result is the same sum of averages.

What is sharded comes from a *unit provider* (:class:`ShardUnits`): the parameters' neutral
names and initial values, their units, the variables of stages 1/2 and the forward of stage 3
on gathered units. :class:`SpecUnits` is the spec models' (``toolkit.MLP``/``CNN``/``GPT``: the
unit functions are their forward passes, the same TF ops as ``models/spec.py``'s
``spec_forward``, so every stage computes what data parallel computes);
``keras_shards.KerasUnits`` is a Keras model's (the whole model one unit). The optimizer is
``toolkit.SGD``/``Adam``'s arithmetic on the flat shards, or the user's own elementwise Keras
optimizer (``keras_optim.py``) built over one shard variable per unit (stages 1 and 2 keep one
beside the full parameters, which take its update through the all-gather); its slots are then
the shards' slots, saved as the spec's are, and its own scalars (``opt/iteration``) once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from adapters._update import StepScalars, UpdateRule
from adapters.horovod_tf.keras_optim import named_slots
from adapters.horovod_tf.models.keras_native import _np_dtype, assign, to_host
from adapters.horovod_tf.models.layers import float32_products
from adapters.horovod_tf.models.units import unit_functions
from adapters.horovod_tf.update import spec_update, step_scalars, sum_squares, update
from toolkit import GPT, Sharded
from toolkit.models.reference import optimizer_slots
from toolkit.parallel.shards import FlatLayout, unit_layouts


class ShardUnits(Protocol):
    """What :class:`ShardedTF` shards: a model's parameters cut into units, and its forward.

    Attributes:
        init: this rank's initial parameters (neutral name -> array, in flat order); rank 0's
            become every rank's.
        compute_gather: whether stage 3 gathers in the compute dtype under mixed precision
            (the forward then takes the parameters in it), or in the parameters' own.
    """

    init: dict[str, np.ndarray]
    compute_gather: bool

    def layouts(self, world_size: int) -> dict[str, FlatLayout]:
        """One flat layout per unit, by unit name, in the forward's order."""

    def variables(self, values: dict[str, np.ndarray]) -> dict[str, Any]:
        """Stages 1/2: the full parameters (neutral name -> variable) holding ``values``."""

    def release(self) -> None:
        """Stage 3: drops any full copy of the parameters the model itself holds."""

    def functions(self, count: int) -> list[tuple[Callable, tuple[int, ...]]]:
        """Stage 3: per unit (``count`` of them) ``fn(params, h, x) -> h`` and the units whose
        parameters it reads; the first reads ``x``, the last returns the model's output."""

    def forward(self, run: Callable[[Any], Any], x: Any, training: bool) -> Any:
        """Stage 3: the model's output, where ``run(x)`` runs the units' functions on ``x``
        (each gathering its parameters)."""


class SpecUnits:
    """A spec model's units (:class:`ShardUnits`): ``toolkit.parallel.shards.unit_layouts`` of
    its parameters ``init`` (``spec.init``'s) and ``models/units.py``'s unit functions."""

    compute_gather = True

    def __init__(self, tf: Any, spec: Any, init: dict[str, np.ndarray]):
        self.tf, self.spec, self.init = tf, spec, init

    def layouts(self, world_size: int) -> dict[str, FlatLayout]:
        return unit_layouts({n: a.shape for n, a in self.init.items()}, world_size)

    def variables(self, values: dict[str, np.ndarray]) -> dict[str, Any]:
        return {n: self.tf.Variable(a, name=n.replace(".", "_")) for n, a in values.items()}

    def release(self) -> None:
        pass  # (the spec model holds no variables of its own)

    def functions(self, count: int) -> list[tuple[Callable, tuple[int, ...]]]:
        return unit_functions(self.tf, self.spec, count)

    def forward(self, run: Callable[[Any], Any], x: Any, training: bool) -> Any:
        del training  # (no layer of a spec behaves otherwise in training)
        tf = self.tf
        if isinstance(self.spec, GPT):
            x = tf.convert_to_tensor(x)
            if x.dtype not in (tf.int32, tf.int64):
                x = tf.cast(x, tf.int64)
        return run(x)


class ShardedTF:
    """The sharded state of a model and optimizer on one rank, and its compiled step.

    Made by ``sharded.TFSharded`` (the strategy), which keeps the host side (the update rule's
    step count and Adam's scalars, inputs, losses).

    Args:
        runtime: the started runtime (its ``tf``, ``hvd``, ``dtype``).
        layout: the ``toolkit.Sharded`` layout.
        model: the model's units (:class:`ShardUnits`: :class:`SpecUnits` or
            ``keras_shards.KerasUnits``).
        rule: the build's ``adapters._update.UpdateRule`` (its optimizer spec, clip, skip).
        local_grads: ``(x, y, variables, scale) -> (gradients, mean loss)`` of this rank's
            batch (the gradients of the loss times ``scale`` under loss scaling).
        keras_opt: the user's Keras optimizer, or None.
        precision: the strategy's precision plugin (``TFPrecision``): its compute dtype under
            mixed precision (stage 3 gathers in it) and the step's loss scale.
        recompute: ``activation_checkpointing`` (None: the layout's choice); stage 3 keeps
            each unit's forward tape for its backward when False (``keep``), else recomputes.

    Attributes:
        vars: stages 1/2: the full parameters (neutral name -> variable); stage 3: empty.
        names: the parameters' neutral names, in ``model.init`` order.
    """

    def __init__(self, runtime: Any, layout: Sharded, model: ShardUnits, rule: UpdateRule,
                 local_grads: Callable, keras_opt: Any = None, precision: Any = None,
                 recompute: bool | None = None):
        tf, hvd = runtime.tf, runtime.hvd
        self.precision, self.keep = precision, recompute is False
        self.compute = None if precision is None or not model.compute_gather \
            else precision.compute
        self.rule, optimizer = rule, rule.spec
        self.tf, self.hvd, self.local_grads = tf, hvd, local_grads
        self.dtype, self.np_dtype = runtime.dtype, runtime.dtype_name
        self.stage, self.model, self.opt = layout.dims.zero, model, optimizer
        # the shard arithmetic's "rank": this rank's place in its data-parallel group (all
        # ranks, or under HSDP a replica's), every shard collective over that group
        self.group, self.barrier = runtime.shard_group(layout), runtime.barrier
        self.size, self.rank = self.group.size, self.group.index
        self._in = {"process_set": self.group.shards}
        init = model.init
        self.layouts = model.layouts(self.size)
        self.units = list(self.layouts)
        dtype = self.dtype
        flats = {}  # rank 0's initial parameters, one flat buffer per unit
        for u, lay in self.layouts.items():
            flat = tf.constant(lay.flatten(init).astype(self.np_dtype))
            flats[u] = hvd.broadcast(flat, root_rank=0, name=f"init_{u}").numpy()
        if self.stage == 3:
            self.vars: dict[str, Any] = {}
            model.release()
        else:
            self.vars = model.variables({n: a for u, lay in self.layouts.items()
                                         for n, a in lay.unflatten(flats[u]).items()})
        self.keras_opt = keras_opt
        if self.stage == 3 or keras_opt is not None:  # (the Keras optimizer's variables)
            self.params = {u: tf.Variable(self._mine(u, flats[u]), name=f"shard_{u}")
                           for u in self.units}
        self.names = list(init)
        if keras_opt is None:
            self.slots = {(slot, u): tf.Variable(tf.zeros([lay.shard_size], dtype),
                                                 trainable=False)
                          for slot in optimizer_slots(optimizer)
                          for u, lay in self.layouts.items()}
            self.extras: dict[str, Any] = {}
        else:
            self.slots, self.extras = self._keras_slots()
        self.grads = {u: tf.Variable(tf.zeros([lay.padded if self.stage == 1 else
                                               lay.shard_size], dtype), trainable=False)
                      for u, lay in self.layouts.items()}
        if self.stage == 3:
            self.unit_fns = model.functions(len(self.units))

    def _keras_slots(self) -> tuple[dict[tuple[str, str], Any], dict[str, Any]]:
        """The Keras optimizer built over the shard variables: its per-shard slots by
        ``(slot, unit)``, and its own variables by checkpoint name (``opt/iteration``)."""
        self.keras_opt.build([self.params[u] for u in self.units])
        named = named_slots(self.keras_opt, self.params)
        slots, extras = {}, {}
        for key, var in named.items():
            slot, _, unit = key[len("opt/"):].partition("/")
            if unit in self.params:
                slots[(slot, unit)] = var
            else:
                extras[key] = var
        return slots, extras

    # ----------------------------------------------------------------------- flat buffers
    def _mine(self, unit: str, flat: np.ndarray) -> np.ndarray:
        size = self.layouts[unit].shard_size
        return flat[self.rank * size:(self.rank + 1) * size]

    def _flatten(self, unit: str, tensors: dict) -> Any:
        """The unit's padded flat buffer of full tensors (zeros in the padding)."""
        tf, lay = self.tf, self.layouts[unit]
        parts = [tf.reshape(tensors[n], [-1]) for n in lay.names]
        if lay.padded > lay.total:
            parts.append(tf.zeros([lay.padded - lay.total], self.dtype))
        return tf.concat(parts, 0)

    def _owned(self, unit: str, tensors: dict) -> Any:
        """This rank's shard of the unit's full tensors (only its pieces are sliced)."""
        tf, lay = self.tf, self.layouts[unit]
        parts = [tf.reshape(tensors[n], [-1])[a:b] for n, a, b, _ in lay.owned(self.rank)]
        held = sum(b - a for _, a, b, _ in lay.owned(self.rank))
        if held < lay.shard_size:
            parts.append(tf.zeros([lay.shard_size - held], self.dtype))
        return tf.concat(parts, 0)

    def _unflatten(self, unit: str, flat: Any) -> dict:
        tf, lay = self.tf, self.layouts[unit]
        return {n: tf.reshape(flat[o:o + s], shape) for n, shape, o, s
                in zip(lay.names, lay.shapes, lay.offsets, lay.sizes, strict=True)}

    def _reduce_scatter(self, unit: str, flat: Any) -> Any:
        """This rank's shard of the average over ranks of ``flat`` (a padded unit buffer)."""
        shard = self.hvd.reducescatter(flat, op=self.hvd.Average, **self._in)
        return self.tf.reshape(shard, [self.layouts[unit].shard_size])

    # ----------------------------------------------------------------------- stage 3
    def _gather(self, shard: Any) -> Any:
        """A unit's padded buffer from every rank's shard: under mixed precision in the
        compute dtype (FSDP2's ``param_dtype``: half the bytes in 16 bits, sent as their bit
        patterns), the values the arithmetic would cast the float32 parameters to; the
        gradient's reduce-scatter stays float32 (``_run_unit``)."""
        tf = self.tf
        if self.compute is None:
            return self.hvd.allgather(shard, **self._in)
        low = tf.bitcast(tf.cast(shard, self.compute), tf.int16)
        return tf.bitcast(self.hvd.allgather(low, **self._in), self.compute)

    def forward(self, x: Any, training: bool = True) -> Any:
        """The model's output (stage 3): its units' forward (``model.forward``), unit by
        unit, each gathering its parameters."""
        return self.model.forward(self._run_units, x, training)

    def _run_units(self, x: Any) -> Any:
        h = None
        for i, (fn, needs) in enumerate(self.unit_fns):
            h = self._run_unit(fn, [self.units[j] for j in needs], x, h, first=i == 0)
        return h

    def _run_unit(self, fn: Callable, needs: list[str], x: Any, h: Any, first: bool) -> Any:
        """``fn(params, h, x)`` with the gathered parameters of the units ``needs``; the
        first unit reads ``x`` (no gradient) instead of an input activation. Its backward
        gathers and runs ``fn`` again under a tape, or (``self.keep``) takes the forward's."""
        tf = self.tf
        shards = [tf.convert_to_tensor(self.params[u]) for u in needs]  # watched reads

        def params_of(fulls):
            out = {}
            for u, full in zip(needs, fulls, strict=True):
                out.update(self._unflatten(u, full))
            return out

        def taped(mine, h_in):
            """The gathered buffers, ``fn``'s output and the tape that watched them and ``h_in``."""
            fulls = [self._gather(s) for s in mine]
            with tf.GradientTape() as tape:
                tape.watch(fulls)
                if not first:
                    tape.watch(h_in)
                with float32_products():  # (a custom gradient: no fused bias, models/layers.py)
                    out = fn(params_of(fulls), h_in, x)
            return fulls, out, tape

        @tf.custom_gradient
        def unit(*args):
            h_in, mine = (None, args) if first else (args[0], args[1:])
            if not first:  # gather once the previous unit is done, not all units at once
                with tf.control_dependencies([h_in]):
                    mine = [tf.identity(s) for s in mine]
            if self.keep:  # the tape keeps the gathered buffers until the backward
                kept = taped(mine, h_in)
                out = kept[1]
            else:
                with float32_products():
                    out = fn(params_of([self._gather(s) for s in mine]), h_in, x)

            def grad(dout):
                if self.keep:
                    fulls, result, tape = kept
                else:  # gather again only once the backward pass reaches this unit
                    with tf.control_dependencies([dout]):
                        again = [tf.identity(s) for s in mine]
                    fulls, result, tape = taped(again, h_in)
                sources = fulls if first else [h_in, *fulls]
                grads = tape.gradient(result, sources, output_gradients=dout,
                                      unconnected_gradients=tf.UnconnectedGradients.ZERO)
                dfull = grads if first else grads[1:]
                dshards = [self._reduce_scatter(u, tf.cast(g, self.dtype))  # (float32)
                           for u, g in zip(needs, dfull, strict=True)]
                return dshards if first else [grads[0], *dshards]

            return out, grad

        return unit(*shards) if first else unit(h, *shards)

    # ----------------------------------------------------------------------- the step
    def step_fn(self, x, y, scalars, keep: list | tuple = ()):
        """One compiled step: local gradients, the stage's reduction, the gradient's norm (and
        clipping), the sharded update; ``keep``: what a skipped step assigns back (``update``).
        Returns the mean loss and the norm before clipping (or the deferred step's
        ``Report``)."""
        s = step_scalars(self.tf, scalars)
        tf, hvd = self.tf, self.hvd
        scale = self.precision.step_scale(s)
        if self.stage == 3:
            grads, total = self.local_grads(x, y, [self.params[u] for u in self.units], scale)
        else:
            full, total = self.local_grads(x, y, [self.vars[n] for n in self.names], scale)
            full = dict(zip(self.names, full, strict=True))
            grads = [hvd.allreduce(self._flatten(u, full), op=hvd.Average) if self.stage == 1
                     else self._reduce_scatter(u, self._flatten(u, full)) for u in self.units]
        if self.stage > 1 and self.group.replicas is not None:  # (HSDP: once per step)
            grads = hvd.grouped_allreduce(grads, op=hvd.Average,
                                          process_set=self.group.replicas)
        # stage 1: the whole gradient on every rank; 2 and 3: this rank's shards (zero
        # padding), whose squares add up across ranks
        def squares(grads: list) -> Any:
            sq = sum_squares(tf, grads)
            if self.stage > 1:
                sq = hvd.allreduce(tf.reshape(sq, [1]), op=hvd.Sum, name="zero.grad_norm",
                                   **self._in)[0]
            return sq

        def apply(grads: list) -> None:
            if self.keras_opt is not None:
                self._keras_apply(grads)
                return
            for u, g in zip(self.units, grads, strict=True):
                if self.stage == 3:
                    self.params[u].assign(self._update(u, tf.convert_to_tensor(self.params[u]),
                                                       g, s))
                    continue
                if self.stage == 1:
                    lo = self.rank * self.layouts[u].shard_size
                    g = g[lo:lo + self.layouts[u].shard_size]
                new = self._update(u, self._owned(u, self.vars), g, s)
                for n, t in self._unflatten(u, hvd.allgather(new, **self._in)).items():
                    self.vars[n].assign(t)

        grads, norm = update(tf, self.rule, grads, squares, apply, keep, scalars)
        for u, g in zip(self.units, grads, strict=True):  # a skipped step's too
            self.grads[u].assign(g)
        return total, norm

    def _keras_apply(self, grads: list) -> None:
        """The Keras optimizer's step on this rank's shards (stage 1: its part of the whole
        gradient), then stages 1/2 re-assemble the full parameters."""
        hvd = self.hvd
        if self.stage == 1:
            grads = [g[self.rank * self.layouts[u].shard_size:][:self.layouts[u].shard_size]
                     for u, g in zip(self.units, grads, strict=True)]
        shards = [self.params[u] for u in self.units]
        self.keras_opt.apply_gradients(zip(grads, shards, strict=True))
        if self.stage < 3:
            for u, shard in zip(self.units, shards, strict=True):
                for n, t in self._unflatten(u, hvd.allgather(self.tf.convert_to_tensor(
                        shard), **self._in)).items():
                    self.vars[n].assign(t)

    def _update(self, unit: str, p, g, s: StepScalars):
        """The unit's new flat shard ``p`` (``update.spec_update``, its slots assigned)."""
        slots = {slot: self.slots[(slot, unit)] for slot in optimizer_slots(self.opt)}
        return spec_update(self.tf, self.opt, p, g, slots, s.lr, s.step_size, s.c2_sqrt)

    # ----------------------------------------------------------------------- state
    def _gather_host(self, var: Any) -> np.ndarray:
        return self.hvd.allgather(self.tf.convert_to_tensor(var), **self._in).numpy()

    def state_dict(self) -> dict[str, np.ndarray]:
        """Full tensors under the neutral names, on every rank (gathered)."""
        out = {}
        for u, lay in self.layouts.items():
            if self.stage == 3:
                out.update({f"params/{n}": a for n, a
                            in lay.unflatten(self._gather_host(self.params[u])).items()})
            else:
                out.update({f"params/{n}": np.array(self.vars[n].numpy())
                            for n in lay.names})
        for (slot, u), var in self.slots.items():
            out.update({f"opt/{slot}/{n}": a for n, a
                        in self.layouts[u].unflatten(self._gather_host(var)).items()})
        if self.group.replicas is not None:
            # every rank waits for every other after gathers inside the shards' group
            # (HSDP): a rank that went on and ended its process would shut Horovod down
            # under a group still gathering
            self.barrier()
        return {**out, **{k: to_host(v) for k, v in self.extras.items()}}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """Takes this rank's shards of full tensors (as ``state_dict`` returns them)."""
        np_dtype = self.np_dtype
        for u, lay in self.layouts.items():
            params = {n: state[f"params/{n}"] for n in lay.names}
            if self.stage == 3 or self.keras_opt is not None:
                self.params[u].assign(lay.shard(params, self.rank).astype(np_dtype))
            if self.stage < 3:
                for n, a in params.items():
                    self.vars[n].assign(np.asarray(a, np_dtype))
        for (slot, u), var in self.slots.items():
            lay = self.layouts[u]
            slots = {n: state[f"opt/{slot}/{n}"] for n in lay.names}
            var.assign(lay.shard(slots, self.rank).astype(np_dtype))
        for key, var in self.extras.items():
            assign(var, state[key])

    def sharded_state(self) -> tuple[dict[str, np.ndarray],
                                     dict[str, tuple[np.ndarray, int, tuple[int, ...]]]]:
        """``(replicated, pieces)`` as ``toolkit.ShardedAdapter`` says (no ``opt/count``: the
        strategy adds it)."""
        replicated, pieces = {}, {}
        # (HSDP: the first replica writes; the others' pieces are empty)
        rank = self.rank if self.group.writes else None
        for u, lay in self.layouts.items():
            if self.stage == 3:
                pieces.update(lay.pieces(self.params[u].numpy(), rank, "params/"))
            else:
                replicated.update({f"params/{n}": np.array(self.vars[n].numpy())
                                   for n in lay.names})
        for (slot, u), var in self.slots.items():
            pieces.update(self.layouts[u].pieces(var.numpy(), rank, f"opt/{slot}/"))
        replicated.update({k: to_host(v) for k, v in self.extras.items()})
        return replicated, pieces

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of the variables this rank holds for parameters (stages 1/2 with a Keras
        optimizer: the full ones and its shard copies), gradients and slots."""
        params = [*self.vars.values(), *getattr(self, "params", {}).values()]
        return {"params": _nbytes(params), "grads": _nbytes(self.grads.values()),
                "optimizer": _nbytes(self.slots.values())}


def _nbytes(variables) -> int:
    return sum(math.prod(v.shape) * np.dtype(_np_dtype(v)).itemsize for v in variables)
