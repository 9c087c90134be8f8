"""What a ``horovod-tf`` pipeline stage holds and how it updates: the data-parallel part of a
pipeline layout, one of two, chosen once by the layout's dimensions (:func:`stage_state`).

- :class:`WholeStage` (``pipeline:S:M``): the stage's variables whole on each replica, their
  slots (a spec's, or the Keras optimizer's) and a compiled apply; the executor averages the
  gradient over the stage's replicas (``HvdPipeline._reduced``).
- :class:`ShardedStage` (``pipeline:S:M+sharded:Z``): the stage's optimizer state, gradient and
  (ZeRO-3) parameters in flat shards over the stage's replicas (:class:`StageShards`).

Both give the executor (``pipeline.TFPipeline``) ``gather`` (the step's parameters where no
variable holds them, else None), ``update`` (the family's update path on the step's summed
gradients; returns the norm), ``local``, ``load`` and ``memory_bytes``.

Pipeline x ZeRO, what :class:`StageShards` does:

Each unit of the stage (``toolkit.parallel.shards.unit_layouts`` over its parameters: an MLP's
layers, a GPT's blocks) is one flat buffer padded to a multiple of the stage's replicas ``D``;
replica ``d`` owns elements ``[d L, (d + 1) L)``, so the pieces are the ones ``flat_shards.py``
and every other backend cut. Every collective runs in the stage's Horovod process set.

- ZeRO-1: the stage's variables stay whole; after the rounds the summed gradient is averaged
  over the replicas (the executor's ``_reduced``), each replica updates its shard with its
  slots' shards, and one all-gather per unit re-assembles the variables.
- ZeRO-2: as 1, but each unit's summed gradient is reduce-scattered (averaged) once per step:
  a replica keeps its gradient shard only.
- ZeRO-3: the parameters live only as shards. At the step's start one all-gather per unit gives
  the stage's whole parameters as tensors, which the pieces take in place of variables (and the
  tape watches), held until the step's end (``gather=step``); the gradient as in 2, and the
  update writes the shards.

Gathering per micro-batch (``gather=micro-batch``) is refused here: TensorFlow's tape keeps
every tensor a forward read until that micro-batch's backward, so a parameter gathered for
each micro-batch would stay as many times as micro-batches are in flight: more memory, not
less, unless the forward were recomputed (horovod-torch gathers per micro-batch).

The optimizer is ``toolkit.SGD``/``Adam``'s arithmetic (``update.spec_update``) on the flat
shards, as data parallel's and the reference's. The global norm adds up every rank's shard
squares over the world (the shards partition each stage's gradient; each stage once).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from adapters._horovod.runtime import ShardGroup
from adapters._update import StepScalars
from adapters.horovod_tf.update import apply_update, spec_update, update
from toolkit import SGD, Adam, ToolkitError
from toolkit.errors import describe
from toolkit.models.reference import optimizer_slots
from toolkit.parallel.pipeline.partition import tied_across_stages
from toolkit.parallel.shards import FlatLayout, unit_layouts


def stage_state(layout: Any) -> type:
    """The stage's part for ``layout``: :class:`ShardedStage` when its data dimension shards
    (``pipeline:S:M+sharded:Z``), else :class:`WholeStage`."""
    return ShardedStage if layout.dims.zero else WholeStage


class WholeStage:
    """The stage's variables whole (the executor's ``TFState``), their optimizer and its
    compiled apply (see the module docstring). ``ex``: the executor, after its cut."""

    def __init__(self, ex: Any, model: Any, optimizer: Any):
        self.ex, tf, state = ex, ex.tf, ex.state
        # zero slots over this stage's variables (a spec's), or the Keras optimizer's
        state.build_optimizer(model, optimizer, ex.keras_model, list(state.vars.values()))
        if state.keras_opt is not None:
            variables = [state.vars[n] for n in state.names]
            self.apply = tf.function(lambda grads, s: state.keras_opt.apply_gradients(
                zip([grads[n] for n in state.names], variables, strict=True)),
                reduce_retracing=True)
        else:
            self.apply = tf.function(
                lambda grads, s: apply_update(tf, state.rule.spec, state.vars, state.slots,
                                              grads, StepScalars.of(s)),
                reduce_retracing=True)

    def gather(self) -> None:
        """(the variables hold the parameters)"""

    def update(self, sums: dict[str, Any], scalars: Any, kept: list) -> Any:
        """The stage's summed gradients averaged over its replicas (``_reduced``), then the
        family's update path (unscale, norm over every stage, clip, apply, the old state kept
        where the norm is not finite), eagerly around the compiled apply."""
        ex, names = self.ex, self.ex.mine
        grads = ex._reduced(sums)
        return update(ex.tf, ex.rule, [grads[n] for n in names],
                      lambda g: ex._sum_of_squares(dict(zip(names, g, strict=True))),
                      lambda g: self.apply(dict(zip(names, g, strict=True)), scalars), kept,
                      scalars)[1]

    def local(self) -> dict[str, np.ndarray]:
        ex = self.ex
        return {k: v for k, v in ex.state.state().items() if k not in ex.replicated}

    def pieces(self, catalogue: list) -> dict:
        """Checkpoint pieces: each tensor whole from its owner."""
        return self.ex._owned_pieces(self.local(), catalogue)

    def load(self, state: dict[str, np.ndarray]) -> None:
        """(the executor's ``TFState`` loads the variables and slots)"""

    def memory_bytes(self) -> dict[str, int]:
        return self.ex.state.memory_bytes()


class ShardedStage:
    """The stage's state in flat shards over its replicas (:class:`StageShards`), for spec
    models and optimizers (see the module docstring)."""

    def __init__(self, ex: Any, model: Any, optimizer: Any):
        self.ex = ex
        if ex.native or not isinstance(optimizer, SGD | Adam):
            raise ToolkitError(
                f"horovod-tf shards a pipeline stage of a spec model with a spec optimizer "
                f"(layout {ex.layout.name}), not "
                + ("a Keras model" if ex.native else describe(optimizer)),
                "pass a toolkit.MLP/CNN/GPT and toolkit.SGD/Adam, or drop sharded: (Keras "
                "models and optimizers are sharded by the sharded:Z layout)")
        hvd, replicas = ex.hvd, ex.grid.replicas
        tied = tuple(n for n in tied_across_stages(ex.cut.names_by_stage, ex.pipe)
                     if n in ex.state.vars)
        ends = ex._process_set(ex.grid.end_ranks()) if tied else None

        def reduce_tied(flat):  # (summed over both end stages, averaged over the replicas)
            return hvd.allreduce(flat, op=hvd.Sum, name="zero.grad.tied",
                                 process_set=ends) / replicas

        stage_set = ex._process_set(ex.grid.stage_ranks(ex.stage))
        self.shards = StageShards(ex.tf, hvd, ex.state.vars, ex.layout.dims.zero, optimizer,
                                  ShardGroup(ex.replica, replicas, stage_set, None, True),
                                  tied, reduce_tied)

    def gather(self) -> dict[str, Any] | None:
        return self.shards.gather()

    def update(self, sums: dict[str, Any], scalars: Any, kept: list) -> Any:
        """The stage's gradient shards (``StageShards.reduce``: ZeRO-1 from the replicas'
        average), then the family's update path on them, the norm's squares added over every
        rank's shards (a tied unit's on the first stage), and the shards' step."""
        ex, shards = self.ex, self.shards
        if shards.zero == 1:
            sums = ex._reduced(sums)
        grads = shards.reduce(sums, shards.zero == 1, ex.held)

        def squares(g: list):
            mine = [t for u, t in enumerate(g) if ex.stage == 0 or u != shards.tied_unit]
            total, = ex._grouped_sum([ex._squares(mine)], ex.hvd.global_process_set,
                                     "pipeline.grad_norm")
            return total

        return update(ex.tf, ex.rule, grads, squares, lambda g: shards.step(g, scalars),
                      kept, scalars)[1]

    def local(self) -> dict[str, np.ndarray]:
        return self.shards.state()

    def pieces(self, catalogue: list) -> dict:
        """Checkpoint pieces: each replica's piece of its shards of the tensors its stage is
        the first to hold (a tied unit: the first stage's), nothing gathered; ZeRO-1 and 2's
        whole parameters from their owner."""
        whole, mine = self.shards.pieces()
        return self.ex._owned_pieces(whole, catalogue, mine)

    def load(self, state: dict[str, np.ndarray]) -> None:
        self.shards.load(state)

    def memory_bytes(self) -> dict[str, int]:
        return self.shards.memory_bytes()


class StageShards:
    """The ZeRO state of one pipeline stage (see the module docstring).

    Args:
        tf, hvd: the modules.
        variables: the stage's variables by neutral name, in the model's order (ZeRO-3
            empties the mapping: the shards hold the parameters).
        zero: the ZeRO stage, 1-3.
        spec: ``toolkit.SGD`` or ``toolkit.Adam``.
        group: ``adapters._horovod.runtime.ShardGroup``: the replica's index among the
            stage's ``size`` replicas, and their process set.
        tied: the parameters another stage holds too (a tied embedding on the end stages):
            a unit of their own (the last, :attr:`tied_unit`), the same on both stages, whose
            whole gradient ``reduce_tied`` averages over every rank holding it before this
            replica keeps its shard.
    """

    def __init__(self, tf, hvd, variables: dict[str, Any], zero: int, spec: Any, group: Any,
                 tied: tuple[str, ...] = (), reduce_tied: Any = None):
        self.tf, self.hvd, self.zero, self.spec = tf, hvd, zero, spec
        self.index, self.size, self._in = group.index, group.size, {"process_set": group.shards}
        self.variables, self.reduce_tied = variables, reduce_tied
        self.dtype = next(iter(variables.values())).dtype
        shapes = {n: tuple(v.shape) for n, v in variables.items()}
        self.layouts: list[FlatLayout] = [
            FlatLayout.from_shapes({n: shapes[n] for n in fl.names if n not in tied}, self.size)
            for fl in unit_layouts(shapes, self.size).values()
            if any(n not in tied for n in fl.names)]
        self.tied_unit = None
        if tied:
            self.tied_unit = len(self.layouts)
            self.layouts.append(FlatLayout.from_shapes({n: shapes[n] for n in tied}, self.size))
        self.slot_names = tuple(optimizer_slots(spec))
        shard = [fl.shard_size for fl in self.layouts]
        self.slots = [{s: tf.Variable(tf.zeros([n], self.dtype)) for s in self.slot_names}
                      for n in shard]
        self.grads = ([tf.Variable(tf.zeros([n], self.dtype)) for n in shard]
                      if zero >= 2 else [])
        self.shards: list[Any] = []
        if zero == 3:
            self.shards = [tf.Variable(self._mine(u, self._flat(u, variables)))
                           for u in range(len(self.layouts))]
            variables.clear()  # (the pieces read the gathered tensors: gather())
        # gathers and reduce-scatters since the count was last reset, and the most bytes the
        # step's gathered parameters and whole gradient sums held at once
        self.collectives = {"gather": 0, "reduce_scatter": 0}
        self.peak_transient = 0

    # ------------------------------------------------------------------ flat buffers
    def _flat(self, unit: int, tensors: dict) -> Any:
        """The unit's tensors as its padded flat buffer."""
        tf, fl = self.tf, self.layouts[unit]
        parts = [tf.reshape(tf.cast(tensors[n], self.dtype), [-1]) for n in fl.names]
        return tf.concat([*parts, tf.zeros([fl.padded - fl.total], self.dtype)], 0)

    def _mine(self, unit: int, flat: Any) -> Any:
        n = self.layouts[unit].shard_size
        return flat[self.index * n:(self.index + 1) * n]

    def _unflat(self, unit: int, flat: Any) -> dict[str, Any]:
        tf, fl = self.tf, self.layouts[unit]
        return {n: tf.reshape(flat[o:o + k], s) for n, o, k, s
                in zip(fl.names, fl.offsets, fl.sizes, fl.shapes, strict=True)}

    def _allgather(self, shard: Any, name: str) -> Any:
        return self.hvd.allgather(self.tf.convert_to_tensor(shard), name=name, **self._in)

    # ------------------------------------------------------------------ a step
    def gather(self) -> dict[str, Any] | None:
        """ZeRO-3: the stage's whole parameters (tensors by name) for this step, one all-gather
        per unit; None below ZeRO-3 (the variables are whole)."""
        if self.zero < 3:
            return None
        out: dict[str, Any] = {}
        for unit, shard in enumerate(self.shards):
            self.collectives["gather"] += 1
            out.update(self._unflat(unit, self._allgather(shard, f"zero.gather.{unit}")))
        return out

    def reduce(self, sums: dict[str, Any], averaged: bool, held: dict | None) -> list:
        """This replica's gradient shard per unit from the step's summed gradients ``sums``
        (by name; ``averaged``: ZeRO-1's, already averaged over the replicas), ZeRO-2/3
        reduce-scattering each unit's once. ``held``: the step's gathered parameters, counted
        with the sums in :attr:`peak_transient`."""
        hvd, out = self.hvd, []
        # (ZeRO-1's whole gradient is the pipeline's own, and stays between steps)
        alive = [*(sums.values() if self.zero >= 2 else ()), *(held or {}).values()]
        self.peak_transient = max(self.peak_transient, sum(
            int(np.prod(t.shape)) * t.dtype.size for t in alive))
        for unit in range(len(self.layouts)):
            flat = self._flat(unit, sums)
            if self.zero == 1:
                assert averaged
                out.append(self._mine(unit, flat))
                continue
            if unit == self.tied_unit:  # (averaged whole with the other end stage's)
                shard = self._mine(unit, self.reduce_tied(flat))
                self.grads[unit].assign(shard)
                out.append(shard)
                continue
            self.collectives["reduce_scatter"] += 1
            shard = hvd.reducescatter(flat, op=hvd.Average, name=f"zero.grad.{unit}",
                                      **self._in)
            self.grads[unit].assign(shard)
            out.append(shard)
        return out

    def step(self, grads: list, scalars: Any) -> None:
        """Updates this replica's shards by its (clipped) gradient shards ``grads`` with the
        step's ``scalars``; below ZeRO-3 the variables are re-assembled (one all-gather per
        unit)."""
        s = StepScalars.of(scalars)
        for unit, g in enumerate(grads):
            fl = self.layouts[unit]
            param = (self.shards[unit] if self.zero == 3
                     else self._mine(unit, self._flat(unit, self.variables)))
            new = spec_update(self.tf, self.spec, param, g, self.slots[unit], s.lr,
                              s.step_size, s.c2_sqrt)
            if self.zero == 3:
                self.shards[unit].assign(new)
                continue
            whole = self._unflat(unit, self._allgather(new, f"zero.params.{unit}"))
            for n in fl.names:
                self.variables[n].assign(whole[n])

    # ------------------------------------------------------------------ state
    def state(self) -> dict[str, np.ndarray]:
        """The stage's parameters and slots, whole, under the checkpoint's names (gathered
        over the replicas: a collective of the stage)."""
        out: dict[str, np.ndarray] = {}
        for unit, fl in enumerate(self.layouts):
            if self.zero == 3:
                flat = self._allgather(self.shards[unit], f"zero.state.params.{unit}")
                out.update({f"params/{n}": np.asarray(t) for n, t
                            in self._unflat(unit, flat).items()})
            else:
                out.update({f"params/{n}": np.asarray(self.variables[n]) for n in fl.names})
            for slot, var in self.slots[unit].items():
                flat = self._allgather(var, f"zero.state.{slot}.{unit}")
                out.update({f"opt/{slot}/{n}": np.asarray(t) for n, t
                            in self._unflat(unit, flat).items()})
        return out

    def pieces(self) -> tuple[dict[str, np.ndarray], dict[str, tuple]]:
        """``(whole, pieces)``: below ZeRO-3 the stage's whole parameters; this replica's piece
        of each tensor in its shards (``(flat piece, 0, full shape)``, empty where its shard
        holds none of it), of the slots and ZeRO-3's parameters."""
        whole: dict[str, np.ndarray] = {}
        mine: dict[str, tuple] = {}
        for unit, fl in enumerate(self.layouts):
            if self.zero == 3:
                mine.update(fl.pieces(np.asarray(self.shards[unit]), self.index, "params/"))
            else:
                whole.update({f"params/{n}": np.asarray(self.variables[n]) for n in fl.names})
            for slot, var in self.slots[unit].items():
                mine.update(fl.pieces(np.asarray(var), self.index, f"opt/{slot}/"))
        return whole, mine

    def load(self, state: dict[str, np.ndarray]) -> None:
        """This replica's shards (and below ZeRO-3 the whole variables) from a full state."""
        for unit, fl in enumerate(self.layouts):
            params = {n: state[f"params/{n}"] for n in fl.names}
            if self.zero == 3:
                self.shards[unit].assign(fl.shard(params, self.index))
            else:
                for n in fl.names:
                    self.variables[n].assign(params[n])
            for slot, var in self.slots[unit].items():
                var.assign(fl.shard({n: state[f"opt/{slot}/{n}"] for n in fl.names},
                                    self.index))

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of what the stage holds between steps: its parameters (whole, or ZeRO-3's
        shards), its gradient (whole as a size below ZeRO-2: the step's average; else the
        shards) and the slots' shards."""
        def nbytes(tensors) -> int:
            return int(sum(int(np.prod(t.shape)) * t.dtype.size for t in tensors))

        whole = sum(fl.total for fl in self.layouts) * self.dtype.size
        params = nbytes(self.shards) if self.zero == 3 else nbytes(self.variables.values())
        return {"params": params, "grads": nbytes(self.grads) if self.zero >= 2 else whole,
                "optimizer": nbytes(v for slots in self.slots for v in slots.values())}
