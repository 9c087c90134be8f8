"""ZeRO stages 1-3 / FSDP for the ``horovod-torch`` backend, with Horovod's collectives only.

The model's parameters live in one flat, padded buffer per unit
(``toolkit.parallel.shards.FlatLayout`` over the neutral names and shapes, so every backend
cuts the same pieces): the whole buffer on every rank for stages 1 and 2, only this rank's
shard for stage 3. The torch module never owns them: each parameter attribute of each
submodule becomes a property (on a per-module subclass, the way
``torch.nn.utils.parametrize`` does it) that returns a view of its unit's current tensors,
permuted into torch's layout where that differs (``Linear.weight`` is the neutral kernel
transposed, ``Conv2d.weight`` the HWIO kernel as OIHW).

A unit's tensors are made, once per forward pass, by ``UnitParams``, a
``torch.autograd.Function``:

- forward: stages 1/2: views of the full buffer; stage 3: ``hvd.allgather`` of the rank's shard
  (all ranks' shards concatenated = the padded buffer), then views of it.
- backward: the unit's gradients written into one flat padded buffer; stage 1 adds it to the
  full gradient buffer (averaged with one grouped ``allreduce`` per step); stages 2 and 3
  ``hvd.reducescatter(op=Average)`` it and add this rank's shard to the persistent gradient
  shard. The backward of the gather is therefore a reduce-scatter, never Horovod's own
  allgather gradient (a full-size allreduce). Stages 2 and 3 reduce each micro-batch's
  gradient (with accumulation steps too): that is what keeps a full gradient from ever
  building up on a rank; the sum is the same.

Under a pipeline (``pipeline:S:M+sharded:Z``: the shards' group is a stage's replicas) a
step runs ``M`` micro-batches' forwards and backwards, interleaved. With ``hold`` (the
layout's ``gather=step``, the default) a unit is gathered at its first use in the step and kept
until the step's end, each backward adds its gradient to a full buffer, and one reduce-scatter
per unit at the step's end (:meth:`ShardedParameters.reduce`) gives the gradient shard: one
gather and one reduce-scatter per unit per step, at the memory of the unit's full parameters
and gradient while the step runs (torchtitan's ``reshard_after_forward=False`` under a
pipeline, with the gradient's reduction held to the last micro-batch). Without it
(``gather=micro-batch``) every micro-batch gathers and reduce-scatters as below: the least
memory, ``M`` times the collectives. :attr:`ShardedParameters.collectives` counts both.

Stage 3 frees a unit's gathered parameters once the forward moves on to the next unit, and
gathers them again for its backward with *saved-tensor hooks*
(``torch.autograd.graph.saved_tensors_hooks``), not activation checkpointing: when an operation
saves a view of a gathered buffer for its backward (a matmul saves its weight), the pack hook
stores (unit, buffer, offset, size, stride) instead; the first unpack in the backward
all-gathers the unit again, and ``UnitParams.backward`` (after every use of the unit has had
its backward) drops that copy. So no unit's forward is recomputed, a unit whose saved tensors
hold none of its parameters is not gathered again, and between steps a rank holds only shards.
Under mixed precision the buffers are 16-bit and float32 (``compute_gather.py``). A unit used
twice in one forward (a tied embedding at the head) is gathered twice and reduce-scatters
twice; both contributions add up in its gradient shard. As in any FSDP, every rank must touch
the units in the same order (a native module's forward must not branch on its rank's data).

The optimizer is ``toolkit/models/reference.py``'s arithmetic on flat shards (Adam's bias
corrections computed on the host in float64, as the data-parallel path's ``torch.optim`` does;
the step count and those scalars are the strategy's ``adapters._update.UpdateRule``), or the
user's own elementwise ``torch.optim`` optimizer (``torch_optim.py``): its groups then hold, in
place of each parameter, a view of this rank's piece of it in the flat shard (the gradient
shard's view as its ``.grad``), and its state tensors are views of the same flat slot buffers
the spec's slots are, so both save and load alike. Padding elements get zero gradients and
stay zero. A step is :meth:`ShardedParameters.reduce`, the family's update path
(``update.py``) with :meth:`ShardedParameters.sum_of_squares`, then
:meth:`ShardedParameters.step`; stages 1 and 2 then re-assemble the parameters with one
grouped ``allgather``.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import numpy as np

from adapters._horovod.runtime import ShardGroup
from adapters._update import StepScalars
from adapters.horovod_torch import torch_optim
from adapters.horovod_torch.compute_gather import ComputeGather, rounded_names
from adapters.horovod_torch.models.units import (
    SHARDABLE,
    native_units,
    permutation,
    spec_units,
    update_shard,
)
from adapters.horovod_torch.ops import NEUTRAL_SLOTS
from toolkit import SGD, Adam
from toolkit.models.reference import optimizer_slots
from toolkit.parallel.shards import FlatLayout

__all__ = ["SHARDABLE", "ShardedParameters", "native_units", "spec_units"]


def _unit_function(torch):
    class UnitParams(torch.autograd.Function):
        """Forward: a unit's parameters (gathered in stage 3) as views; backward: their
        gradients reduced (see the module docstring). ``record`` is this use of the unit."""

        @staticmethod
        def forward(ctx, source, record):
            ctx.record = record
            return record.owner._open(record, source)

        @staticmethod
        def backward(ctx, *grads):
            ctx.record.owner._close(ctx.record, grads)
            return None, None  # the gradient went into the owner's buffers

    return UnitParams


class _Use:
    """One materialisation of one unit's parameters in one forward pass."""

    __slots__ = ("owner", "unit", "ptrs", "regathered")

    def __init__(self, owner, unit: int):
        self.owner, self.unit, self.ptrs, self.regathered = owner, unit, (), None


class _SavedView:
    """What stage 3's pack hook saves instead of a view of a gathered buffer."""

    __slots__ = ("use", "buffer", "offset", "size", "stride")

    def __init__(self, use: _Use, buffer: int, t):
        self.use, self.buffer = use, buffer
        self.offset, self.size, self.stride = t.storage_offset(), t.size(), t.stride()


class ShardedParameters:
    """A module's parameters, gradients and optimizer state sharded as ``Sharded(stage)``.

    Duck-types the optimizer for the adapter's step: :meth:`zero_grad`, then every forward
    inside :meth:`forwarding` and its backward, then :meth:`reduce`, and :meth:`step` with the
    (clipped) :attr:`grads` (``update.update``, with :meth:`sum_of_squares`).

    Args:
        torch, hvd: the modules (imported by the adapter).
        net: the torch module; its parameter attributes are re-routed to the flat buffers.
        layout: ``(neutral name, torch parameter, to_torch, from_torch)`` per parameter.
        arrays: neutral name -> initial value (numpy, neutral layout), in the model's order.
        units: unit name -> neutral names in it.
        stage: 1, 2 or 3.
        optimizer: ``toolkit.SGD`` or ``toolkit.Adam``, or an elementwise ``torch.optim``
            optimizer over ``net``'s parameters (``torch_optim.check_elementwise``).
        dtype, device: the torch dtype and device (the rank's GPU, or the CPU) of every buffer.
        compute: stage 3 gathers a spec model's units in this dtype (``compute_gather.py``).
        group: where this rank's shards sit (``adapters._horovod.runtime.ShardGroup``: all
            ranks, or under HSDP its replica's, and the replicas it averages across; under a
            pipeline its stage's replicas).
        hold: gather each unit once per step and reduce its gradient once, at :meth:`reduce`
            (a pipeline's micro-batches: the module docstring), rather than per forward.
        whole: units whose gradient another group also holds (a pipeline's tied embedding, a
            unit of its own on both end stages), each with the function that averages its
            whole flat gradient sum over every rank holding it: their gradient is summed
            whole over the step and reduced by it at :meth:`reduce`, this rank then keeping
            its shard.

    ``net``'s parameters that ``layout`` does not name stay as they are (another pipeline
    stage's), and so do a native optimizer's other parameters.
    """

    def __init__(self, torch, hvd, net, layout, arrays: dict[str, np.ndarray],
                 units: dict[str, list[str]], stage: int, optimizer, dtype, device=None,
                 compute=None, *, group: ShardGroup, hold: bool = False,
                 whole: dict[str, Any] | None = None):
        self.torch, self.hvd, self.stage, self.spec = torch, hvd, stage, optimizer
        self.group, self.hold = group, hold
        self.whole = {list(units).index(u): f for u, f in (whole or {}).items()}
        # what the step's collectives were: gathers and reduce-scatters since the count
        # was last reset (a pipeline's test reads it per step)
        self.collectives = {"gather": 0, "reduce_scatter": 0}
        self._held: dict[int, tuple] = {}  # hold: unit -> its gathered buffers this step
        self._sums: dict[int, Any] = {}  # hold, stages 2/3: unit -> its full gradient sum
        # the gathered buffers and full gradient sums alive (weakly: autograd and the caches
        # own them), and the most bytes they held at once: what a step adds to the shards
        self._alive: weakref.WeakSet = weakref.WeakSet()
        self.peak_transient = 0
        # (the shard arithmetic's "rank": this rank's place in its data-parallel group)
        self.rank, self.size = self.group.index, self.group.size
        self._in = {"process_set": self.group.shards}  # every shard collective's group
        self.layouts = [FlatLayout.from_shapes({n: np.shape(arrays[n]) for n in names},
                                               self.size) for names in units.values()]
        self.native = None if isinstance(optimizer, SGD | Adam) else optimizer
        if self.native is None:
            self.slot_names = optimizer_slots(optimizer)
        else:
            templates = torch_optim.state_templates(torch, optimizer)
            self.slot_names = torch_optim.slot_names(templates)
        self.sources, self.grads, self.slots = [], [], []
        for unit, flat_layout in enumerate(self.layouts):
            flat = flat_layout.flatten({n: arrays[n] for n in flat_layout.names})
            held = flat if stage < 3 else flat[self._owned(unit)]
            self.sources.append(torch.tensor(held, dtype=dtype, device=device).requires_grad_())
            grad_len = flat_layout.padded if stage == 1 else flat_layout.shard_size
            self.grads.append(torch.zeros(grad_len, dtype=dtype, device=device))
            self.slots.append({s: torch.zeros(flat_layout.shard_size, dtype=dtype, device=device)
                               for s in self.slot_names})
        self._fn = _unit_function(torch)
        # stage 3's all-gathers: in the compute dtype for a spec model (compute_gather.py)
        compute = compute if stage == 3 else None
        self._gather = ComputeGather(torch, hvd, self.layouts, self.rank, compute,
                                     rounded_names(arrays) if compute is not None else (),
                                     device, None if self.group.shards is hvd.global_process_set
                                     else self.group.shards)
        self._cache: dict[int, tuple] = {}  # unit -> its tensors in the current forward
        self._live: dict[int, _Use] = {}  # storage address -> stage 3's current gathered unit
        if self.native is not None:
            self._bind(layout, templates)
        self._route(net, layout)

    # ---------------------------------------------------------------------- the module's view
    def _owned(self, unit: int) -> slice:
        """This rank's elements of ``unit``'s padded buffer."""
        n = self.layouts[unit].shard_size
        return slice(self.rank * n, (self.rank + 1) * n)

    def _bind(self, layout, templates) -> None:
        """The native optimizer rebound to views of this rank's pieces (module docstring)."""
        torch = self.torch
        unit_of = {n: u for u, fl in enumerate(self.layouts) for n in fl.names}
        by_id = {id(param): name for name, param, _, _ in layout}
        placed = {}  # id(view) -> (unit, start in the shard, length)

        def new(p):
            name = by_id.get(id(p))
            if name is None:  # (another stage's parameter)
                return None
            unit = unit_of[name]
            a, b, at = next(((a, b, at) for n, a, b, at in self.layouts[unit].owned(self.rank)
                             if n == name), (0, 0, 0))
            if b == a:  # none of it on this rank
                return None
            shard = self.sources[unit].detach()
            shard = shard if self.stage == 3 else shard[self._owned(unit)]
            grads = self.grads[unit][self._owned(unit)] if self.stage == 1 else self.grads[unit]
            view = shard[at:at + b - a]
            view.grad = grads[at:at + b - a]
            placed[id(view)] = (unit, at, b - a)
            return view, lambda v: v.detach().reshape(-1)[a:b]

        torch_optim.rebind(self.native, new)

        def slot(view, key):
            unit, at, n = placed[id(view)]
            return self.slots[unit][NEUTRAL_SLOTS.get(key, key)][at:at + n]

        with torch.no_grad():
            torch_optim.fill_state(torch, self.native, templates, slot)

    def _route(self, net, layout) -> None:
        """Every parameter attribute of ``net``'s modules becomes a property returning its view."""
        where = {}
        for name, param, to_torch, _ in layout:
            unit = next(u for u, fl in enumerate(self.layouts) if name in fl.names)
            index = self.layouts[unit].names.index(name)
            where[id(param)] = (unit, index, permutation(to_torch,
                                                          self.layouts[unit].shapes[index]))
        for module in net.modules():
            routed = {attr: where[id(p)] for attr, p in module._parameters.items()
                      if p is not None and id(p) in where}
            if not routed:
                continue
            props = {attr: property(lambda _, at=at: self.tensor(*at))
                     for attr, at in routed.items()}
            module.__class__ = type(type(module).__name__, (type(module),), props)
            for attr in routed:
                del module._parameters[attr]
        for _, param, _, _ in layout:  # the flat buffers hold the state now: free the old
            param.data = self.torch.empty(0, dtype=param.dtype, device=param.device)

    def tensor(self, unit: int, index: int, perm: tuple[int, ...] | None):
        """Parameter ``index`` of ``unit`` in torch's layout, for the current forward pass."""
        tensors = self._cache.get(unit)
        if tensors is None:
            if self.stage == 3 and not self.hold:  # the previous unit's gathered buffer is freed
                self._cache.clear()
                self._live.clear()
            use = _Use(self, unit)
            tensors = self._fn.apply(self.sources[unit], use)
            self._cache[unit] = tensors
            if self.stage == 3 and not self.hold:
                self._live.update({ptr: (use, i) for i, ptr in enumerate(use.ptrs)})
        t = tensors[index]
        return t if perm is None else t.permute(perm)

    @contextlib.contextmanager
    def forwarding(self):
        """Wrap each forward pass: stage 3's saved-tensor hooks, and no tensors kept after."""
        self._cache.clear()
        hooks = (self.torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
                 if self.stage == 3 and not self.hold else contextlib.nullcontext())
        try:
            with hooks:
                yield
        finally:
            self._cache.clear()
            self._live.clear()

    def _pack(self, t):
        try:
            found = self._live.get(t.untyped_storage().data_ptr())
        except RuntimeError:  # a tensor without storage: never one of ours
            return t
        return t if found is None else _SavedView(*found, t)

    def _unpack(self, saved):
        if type(saved) is not _SavedView:
            return saved
        use = saved.use
        if use.regathered is None:  # the unit's backward begins: gather it again
            use.regathered = self._gathered(use.unit, self.sources[use.unit].detach())
        return use.regathered[saved.buffer].as_strided(saved.size, saved.stride, saved.offset)

    # ---------------------------------------------------------------------- collectives
    def _open(self, use: _Use, source) -> tuple:
        """UnitParams.forward: the unit's parameters as neutral-shaped views of its gathered
        buffers (stage 3: ``compute_gather.py``; else the full buffer itself)."""
        if self.stage < 3:
            buffers = (source,)
        elif self.hold:
            buffers = self._held.get(use.unit) or self._held.setdefault(
                use.unit, self._gathered(use.unit, source))
        else:
            buffers = self._gathered(use.unit, source)
        use.ptrs = tuple(b.untyped_storage().data_ptr() for b in buffers)
        fl = self.layouts[use.unit]
        return tuple(buffers[b][o:o + n].view(s) for (b, o), n, s
                     in zip(self._gather.places[use.unit], fl.sizes, fl.shapes, strict=True))

    def _gathered(self, unit: int, source) -> tuple:
        self.collectives["gather"] += 1
        return self._track(*self._gather(unit, source))

    def _track(self, *tensors) -> tuple:
        """``tensors`` (gathered buffers, a full gradient sum) counted in
        :attr:`peak_transient` while alive."""
        self._alive.update(tensors)
        alive = sum(t.numel() * t.element_size() for t in self._alive)
        self.peak_transient = max(self.peak_transient, alive)
        return tensors

    def _close(self, use: _Use, grads) -> None:
        """UnitParams.backward: the unit's gradients, reduced into its gradient buffer (held
        in a full sum until :meth:`reduce` when ``hold``)."""
        use.regathered = None  # every use of the unit has had its backward
        fl, target = self.layouts[use.unit], self.grads[use.unit]
        summed = self.hold or use.unit in self.whole  # (reduced once, at reduce())
        if self.stage > 1:
            target = self._sums.get(use.unit) if summed else None
            if target is None:
                target, = self._track(self.grads[use.unit].new_zeros(fl.padded))
                if summed:
                    self._sums[use.unit] = target
        for o, n, g in zip(fl.offsets, fl.sizes, grads, strict=True):
            if g is not None:
                target[o:o + n].add_(g.reshape(-1))
        if self.stage > 1 and not summed:
            self._scatter(use.unit, target)

    def _scatter(self, unit: int, flat) -> None:
        """The unit's full gradient ``flat``, averaged over the shards' group, added to this
        rank's gradient shard."""
        hvd = self.hvd
        self.collectives["reduce_scatter"] += 1
        self.grads[unit].add_(hvd.reducescatter(flat, op=hvd.Average, name=f"zero.grad.{unit}",
                                                **self._in))

    # ---------------------------------------------------------------------- the update
    def zero_grad(self) -> None:
        for g in self.grads:
            g.zero_()

    def reduce(self) -> None:
        """Stage 1 averages the full gradient buffers across every rank holding this part of
        the model; stages 2 and 3 reduce-scattered theirs in the backward (or, holding, do it
        now: once per unit), and (HSDP) average each shard across its replicas here, once per
        step. The step's gathered units are let go."""
        hvd = self.hvd
        for unit, flat in sorted(self._sums.items()):
            if unit in self.whole:  # (averaged whole with the other holders: my shard)
                self.grads[unit].add_(self.whole[unit](flat)[self._owned(unit)])
            else:
                self._scatter(unit, flat)
        self._sums.clear()
        self.let_go()
        if self.stage == 1:
            every = self._in if self.group.replicas is None else {}  # (HSDP: every rank)
            rest = [g for u, g in enumerate(self.grads) if u not in self.whole]
            if rest:
                hvd.grouped_allreduce_(rest, op=hvd.Average, name="zero.grads", **every)
            for unit, reduce in self.whole.items():
                self.grads[unit].copy_(reduce(self.grads[unit]))
        elif self.group.replicas is not None:
            hvd.grouped_allreduce_(self.grads, op=hvd.Average, name="zero.grads.replicas",
                                   process_set=self.group.replicas)

    def let_go(self) -> None:
        """Frees the units gathered and held this step (``hold``: at the step's end, or
        after an evaluation)."""
        self._held.clear()

    def sum_of_squares(self, grads: list):
        """The whole gradient's sum of squares (a tensor, the same on every rank) from this
        rank's ``grads`` (:attr:`grads`, after :meth:`reduce`): stage 1's ranks each hold the
        whole gradient; stages 2 and 3 their shards (zero padding), whose squares add up
        across ranks."""
        torch, hvd = self.torch, self.hvd
        sq = torch.stack([g.square().sum() for g in grads]).sum().reshape(1)
        if self.stage > 1:
            sq = hvd.allreduce(sq, op=hvd.Sum, name="zero.grad_norm", **self._in)
        return sq[0]

    def step(self, scalars: StepScalars, found_inf: Any = None) -> None:
        """Updates this rank's shards from :attr:`grads` with this step's ``scalars``
        (``UpdateRule.step_scalars``' by name), then re-assembles the parameters (stages 1/2).
        ``found_inf`` (a deferred step's: a device flag, non-zero where the step must change
        nothing): a native optimizer takes it (torch's fused kernels), the spec arithmetic
        keeps the old shards and slots by a device-side select."""
        torch, hvd, spec = self.torch, self.hvd, self.spec
        with torch.no_grad():
            if self.native is not None:
                if found_inf is not None:
                    self.native.found_inf, self.native.grad_scale = found_inf, None
                self.native.step()  # (over views of the shards: see _bind)
            else:
                for unit, (source, grad, slots) in enumerate(
                        zip(self.sources, self.grads, self.slots, strict=True)):
                    own = self._owned(unit)
                    param = source if self.stage == 3 else source[own]
                    held = [param, *slots.values()]
                    before = [t.clone() for t in held] if found_inf is not None else []
                    update_shard(spec, param, grad[own] if self.stage == 1 else grad, slots,
                                 scalars.lr, scalars.step_size, scalars.c2_sqrt)
                    for now, old in zip(held if before else (), before, strict=True):
                        now.copy_(torch.where(found_inf == 0, now, old))
            if self.stage < 3:
                gathered = hvd.grouped_allgather(
                    [s.detach()[self._owned(u)] for u, s in enumerate(self.sources)],
                    name="zero.params", **self._in)
                for source, full in zip(self.sources, gathered, strict=True):
                    source.copy_(full)

    # ---------------------------------------------------------------------- state
    def _full(self, unit: int, shard, what: str) -> np.ndarray:
        with self.torch.no_grad():
            full = self.hvd.allgather(shard.detach(), name=f"zero.state.{what}.{unit}",
                                      **self._in)
            return full.cpu().numpy()

    def state_dict(self) -> dict[str, np.ndarray]:
        """Full tensors under the neutral names, on every rank (gathers the shards); a spec
        optimizer's step count is the strategy's."""
        out: dict[str, np.ndarray] = {}
        for unit, fl in enumerate(self.layouts):
            source = self.sources[unit].detach()
            flat = self._full(unit, source, "params") if self.stage == 3 else source.cpu().numpy()
            out.update({f"params/{n}": a for n, a in fl.unflatten(flat).items()})
            for slot, shard in self.slots[unit].items():
                full = fl.unflatten(self._full(unit, shard, slot))
                out.update({f"opt/{slot}/{n}": a for n, a in full.items()})
        self._meet()
        return {**out, **self._count()}

    def _meet(self) -> None:
        """Every rank waits for every other after collectives inside the shards' group
        (HSDP): a rank that went on and ended its process would shut Horovod down under a
        group still gathering."""
        if self.group.replicas is not None:
            self.hvd.barrier()

    def _count(self) -> dict[str, np.ndarray]:
        """A native optimizer's step count (a spec's is the strategy's UpdateRule's)."""
        count = None if self.native is None else torch_optim.step_count(self.torch, self.native)
        return {} if count is None else {"opt/count": np.asarray(count, np.int64)}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """Takes this rank's shards of full tensors (from :meth:`state_dict` or a checkpoint)."""
        torch = self.torch
        with torch.no_grad():
            for unit, fl in enumerate(self.layouts):
                params = {n: state[f"params/{n}"] for n in fl.names}
                held = fl.flatten(params) if self.stage < 3 else fl.shard(params, self.rank)
                self.sources[unit].copy_(torch.as_tensor(held))
                for slot, shard in self.slots[unit].items():
                    values = {n: state[f"opt/{slot}/{n}"] for n in fl.names}
                    shard.copy_(torch.as_tensor(fl.shard(values, self.rank)))
            if self.native is not None and "opt/count" in state:
                torch_optim.set_step_count(torch, self.native, int(state["opt/count"]))

    def sharded_state(self) -> tuple[dict[str, np.ndarray], dict[str, tuple]]:
        """``(replicated, pieces)`` as ``toolkit.ShardedAdapter`` says (no buffers or step
        count: the adapter adds them)."""
        replicated: dict[str, np.ndarray] = {}
        pieces: dict[str, tuple] = {}
        # (HSDP: the first replica writes; the others' pieces are empty)
        rank = self.rank if self.group.writes else None
        for unit, fl in enumerate(self.layouts):
            source = self.sources[unit].detach().cpu().numpy()
            if self.stage == 3:
                pieces.update(fl.pieces(source, rank, "params/"))
            else:
                replicated.update({f"params/{n}": a for n, a in fl.unflatten(source).items()})
            for slot, shard in self.slots[unit].items():
                pieces.update(fl.pieces(shard.cpu().numpy(), rank, f"opt/{slot}/"))
        return {**replicated, **self._count()}, pieces

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of the buffers this rank holds between steps (their real sizes)."""
        def nbytes(tensors) -> int:
            return int(sum(t.numel() * t.element_size() for t in tensors))

        return {"params": nbytes(self.sources), "grads": nbytes(self.grads),
                "optimizer": nbytes(t for slots in self.slots for t in slots.values())}
