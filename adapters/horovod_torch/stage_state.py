"""What a ``horovod-torch`` pipeline stage holds and how it updates: the data-parallel part of a
pipeline layout, one of two, chosen once by the layout's dimensions (:func:`stage_state`).

- :class:`WholeStage` (``pipeline:S:M``): the stage's parameters whole on each replica, a
  ``torch.optim`` optimizer over them (the spec's, or the user's elementwise one rebound to the
  stage's parameters); the executor averages the gradient over the stage's replicas
  (``HvdPipeline._reduced``) and the update path applies it.
- :class:`ShardedStage` (``pipeline:S:M+sharded:Z``): the stage's parameters, gradient and
  optimizer state in flat shards over the stage's replicas (``flat_shards.ShardedParameters``,
  the class ``sharded:Z`` uses, its group the stage's process set), gathered once per step or
  per micro-batch as the layout says.

Both give the executor (``pipeline.TorchPipeline``) the same methods: ``forwarding`` (what each
forward runs inside), ``begin`` (a step's learning rate and zeroed gradients), ``update`` (the
family's update path, ``update.update``; returns the norm), ``let_go`` (after an evaluation),
``local`` (the stage's parameters and slots under their neutral names), ``count`` (a native
optimizer's step count), ``load`` and ``memory_bytes``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from adapters._horovod.runtime import ShardGroup
from adapters.horovod_torch.flat_shards import ShardedParameters, native_units, spec_units
from adapters.horovod_torch.models.spec import from_host, same, to_host
from adapters.horovod_torch.ops import (
    NEUTRAL_SLOTS,
    TORCH_SLOTS,
    count_like,
    make_optimizer,
    set_lr,
    zero_slots,
)
from adapters.horovod_torch.torch_optim import (
    check_elementwise,
    fill_state,
    rebind,
    slot_names,
    state_templates,
    step_count,
)
from adapters.horovod_torch.update import update
from toolkit import SGD, Adam
from toolkit.models.reference import optimizer_slots
from toolkit.parallel.layouts import GATHERS
from toolkit.parallel.pipeline.partition import tied_across_stages


def stage_state(layout: Any) -> type:
    """The stage's part for ``layout``: :class:`ShardedStage` when its data dimension shards
    (``pipeline:S:M+sharded:Z``), else :class:`WholeStage`."""
    return ShardedStage if layout.dims.zero else WholeStage


class WholeStage:
    """The stage's parameters whole, and a ``torch.optim`` optimizer over them (see the module
    docstring). ``ex``: the pipeline executor, after its cut (``params``, ``scheduler``)."""

    counts = False  # torch.optim counts its own steps (the UpdateRule does not)

    def __init__(self, ex: Any, model: Any, optimizer: Any):
        self.ex, torch = ex, ex.torch
        params = [p for _, p, _, _ in ex.params]
        if not isinstance(optimizer, SGD | Adam):  # its groups keep this stage's parameters
            check_elementwise(torch, optimizer, "horovod-torch", "pipeline")
            make_optimizer(torch, optimizer, [*params, *getattr(model, "parameters", list)()])
            templates = state_templates(torch, optimizer)
            mine = {id(p) for p in params}
            rebind(optimizer, lambda p: (p, lambda v: v) if id(p) in mine else None)
            fill_state(torch, optimizer, templates)  # as data parallel: state from step 0
            self.opt, self.slots = optimizer, slot_names(templates)
        else:
            self.opt = make_optimizer(torch, optimizer, params)
            zero_slots(torch, self.opt, params, optimizer)
            self.slots = optimizer_slots(optimizer)

    def forwarding(self):
        return contextlib.nullcontext()

    def begin(self, lr: float | None) -> None:
        set_lr(self.opt, lr)
        self.opt.zero_grad(set_to_none=False)

    def update(self, kept: list, lr: float | None) -> Any:
        """The stage's gradients reduced on the device (``_reduced``), then the family's
        update path (unscale, norm over every stage, finite check, clip, the optimizer's step
        at the rate ``begin`` set; ``kept``: the buffers' values before the step, put back when
        it is skipped)."""
        ex, torch = self.ex, self.ex.torch
        grads = ex._reduced({n: torch.zeros_like(p) if p.grad is None else p.grad
                             for n, p, _, _ in ex.params})
        for n, p, _, _ in ex.params:
            p.grad = grads[n]

        def apply(_) -> None:  # (the skip is known on the host here)
            self.opt.step()
            if ex.scheduler is not None:
                ex.scheduler.step()

        return update(torch, ex.rule, list(grads.values()),
                      lambda _: ex._sum_of_squares(grads), apply, kept)[1]

    def let_go(self) -> None:
        """(nothing gathered)"""

    def local(self) -> dict[str, np.ndarray]:
        out = {}
        for n, p, _, from_torch in self.ex.params:
            out[f"params/{n}"] = to_host(p, from_torch)
            for slot in self.slots:  # (zeros where the parameter's group keeps no such slot)
                value = self.opt.state[p].get(TORCH_SLOTS.get(slot, slot))
                out[f"opt/{slot}/{n}"] = to_host(value if value is not None
                                                 else self.ex.torch.zeros_like(p), from_torch)
        return out

    def count(self) -> dict[str, np.ndarray]:
        count = step_count(self.ex.torch, self.opt)
        return {} if count is None else {"opt/count": np.asarray(count, np.int64)}

    def pieces(self, catalogue: list) -> dict:
        """Checkpoint pieces: each tensor whole from its owner."""
        return self.ex._owned_pieces(self.ex._local(), catalogue)

    def load(self, state: dict[str, np.ndarray]) -> None:
        ex, torch = self.ex, self.ex.torch

        def tensor(a, to_torch):
            return from_host(torch, a, to_torch, ex.dtype, ex.runtime.dev)

        with torch.no_grad():
            for n, p, to_torch, _ in ex.params:
                p.copy_(tensor(state[f"params/{n}"], to_torch))
                slots = self.opt.state[p]
                for key in list(slots):
                    slots[key] = (count_like(torch, slots[key], state["opt/count"])
                                  if key == "step" else
                                  tensor(state[f"opt/{NEUTRAL_SLOTS.get(key, key)}/{n}"], to_torch))

    def memory_bytes(self) -> dict[str, int]:
        """The stage's parameters, a gradient of each, their optimizer slots (a tied parameter
        counts on both stages that hold it)."""
        params = self.ex.params
        held = sum(p.nbytes for _, p, _, _ in params)
        slots = sum(v.nbytes for p in (e[1] for e in params)
                    for v in self.opt.state[p].values() if self.ex.torch.is_tensor(v) and v.dim())
        return {"params": held, "grads": held, "optimizer": slots}


class ShardedStage:
    """The stage's state in flat shards over its replicas (see the module docstring)."""

    counts = True  # the spec's arithmetic on the shards: the UpdateRule counts its steps

    def __init__(self, ex: Any, model: Any, optimizer: Any):
        self.ex, torch, dims = ex, ex.torch, ex.layout.dims
        if not isinstance(optimizer, SGD | Adam):  # the user's torch.optim optimizer
            check_elementwise(torch, optimizer, "horovod-torch", ex.layout.name)
            make_optimizer(torch, optimizer, [*(p for _, p, _, _ in ex.params),
                                              *getattr(model, "parameters", list)()])
        if ex.native:
            native_units(torch, ex.cut.root)  # (refuses what cannot be sharded)
        arrays = {n: to_host(p, from_torch) for n, p, _, from_torch in ex.params}
        units: dict[str, list[str]] = {}
        for n in arrays:  # a native layer's parameters a unit (as native_units groups them)
            units.setdefault(n.split(".")[0], []).append(n)
        units, whole = self._tied_unit(units if ex.native else spec_units(arrays))
        stage_set = ex._process_set(ex.grid.stage_ranks(ex.stage))
        # (each replica of a stage holds its own shard: every one writes its pieces)
        group = ShardGroup(ex.replica, ex.grid.replicas, stage_set, None, True)
        self.shards = ShardedParameters(
            torch, ex.hvd, ex.cut.root, ex.params, arrays, units, dims.zero, optimizer,
            ex.dtype, ex.runtime.dev, None if ex.native else ex.precision.autocast,
            group=group, hold=dims.gather == GATHERS[0], whole=whole)
        self.opt = self.shards.native  # (None: the spec's arithmetic on the shards)
        self.slots = tuple(self.shards.slot_names)

    def _tied_unit(self, units: dict[str, list[str]]) -> tuple[dict[str, list[str]], dict]:
        """``units`` with the parameters two stages hold (a tied embedding, on the end
        stages) taken out into a unit of their own, the same on both stages, and that unit's
        reduction: its whole gradient summed over both end stages' ranks (the end stages'
        process set) and averaged over the replicas, as the pipeline sums a tied gradient."""
        ex = self.ex
        tied = set(tied_across_stages(ex.cut.names_by_stage, ex.pipe))
        mine = [n for names in units.values() for n in names if n in tied]
        if not mine:
            return units, {}
        out = {u: [n for n in names if n not in tied] for u, names in units.items()}
        out = {u: names for u, names in out.items() if names}
        out["tied"] = mine
        ends, hvd, replicas = ex._process_set(ex.grid.end_ranks()), ex.hvd, ex.grid.replicas

        def reduce(flat):
            return hvd.allreduce(flat, op=hvd.Sum, name="zero.grad.tied",
                                 process_set=ends) / replicas

        return out, {"tied": reduce}

    def forwarding(self):
        return self.shards.forwarding()

    def begin(self, lr: float | None) -> None:
        if self.opt is not None:
            set_lr(self.opt, lr)
        self.shards.zero_grad()

    def update(self, kept: list, lr: float | None) -> Any:
        """The stage's gradient shards reduced over its replicas (``ShardedParameters.reduce``),
        then the same update path: the norm's squares summed over every stage's shards (ZeRO-1's
        ranks each hold their stage's whole gradient: counted once per replica set; a tied unit
        on the first stage), the shards' step with the step's scalars (the rule counts it)."""
        ex, torch, shards = self.ex, self.ex.torch, self.shards
        scalars = ex.rule.scalars(lr)
        shards.reduce()

        def squares(grads: list):
            mine = ex._squares([g for u, g in enumerate(grads)
                                if ex.stage == 0 or u not in shards.whole])
            total, = ex._grouped_sum([mine], ex.hvd.global_process_set, "pipeline.grad_norm")
            return total / ex.grid.replicas if shards.stage == 1 else total

        def apply(found_inf) -> None:
            shards.step(scalars, found_inf)
            if ex.scheduler is not None:
                ex.scheduler.step()

        return update(torch, ex.rule, shards.grads, squares, apply, kept)[1]

    def let_go(self) -> None:
        self.shards.let_go()

    def local(self) -> dict[str, np.ndarray]:
        """(gathered over the stage's replicas: a collective of the stage)"""
        return {k: v for k, v in self.shards.state_dict().items() if k != "opt/count"}

    def count(self) -> dict[str, np.ndarray]:
        count = None if self.opt is None else step_count(self.ex.torch, self.opt)
        return {} if count is None else {"opt/count": np.asarray(count, np.int64)}

    def pieces(self, catalogue: list) -> dict:
        """Checkpoint pieces: each replica's piece of its shards of the tensors its stage is
        the first to hold (a tied unit: the first stage's), nothing gathered; what the stage
        holds whole (ZeRO-1 and 2's parameters, buffers) from its owner."""
        ex = self.ex
        replicated, mine = self.shards.sharded_state()
        whole = {k: v for k, v in replicated.items() if k.startswith("params/")}
        whole.update({f"buffers/{n}": to_host(b, same) for n, b in ex.cut.buffers})
        return ex._owned_pieces(whole, catalogue, mine)

    def load(self, state: dict[str, np.ndarray]) -> None:
        self.shards.load_state_dict(state)

    def memory_bytes(self) -> dict[str, int]:
        return self.shards.memory_bytes()
