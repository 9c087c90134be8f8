"""The user's own ``torch.optim`` optimizer under the sharded and pipeline layouts.

The user passes the optimizer built over ``model.parameters()`` of a native module, or a
function of the parameters (:func:`built_over`: ``lambda params: torch.optim.AdamW(params,
lr=3e-4)`` returning the optimizer or ``(optimizer, scheduler)``, or the optimizer's class),
which fits a spec model too, whose parameters the backend makes: the backend calls it over the
model's parameters (a pipeline stage: over its own). The optimizer object then stays the one
that steps, so an LR scheduler built over it stays bound: :func:`rebind` replaces, in place,
each parameter in its ``param_groups`` by the tensor this rank updates (a pipeline stage: its
own parameters, the others dropped; a sharded layout: a view of this rank's piece of the
parameter in its unit's flat shard, with a view of the gradient shard as its ``.grad``), as
FSDP2 turns the parameters into local shards before the optimizer is built. Each group keeps
its settings.

That is exact for an *elementwise* optimizer, whose update of an element reads only that
element's parameter, gradient and state: :data:`ELEMENTWISE` lists the ``torch.optim`` classes
this holds for (and that keep no per-tensor scalar besides the step count); any other class is
refused with the reason (:data:`REFUSED`), since it reads a whole tensor (Adafactor's factored
moments, LAMB's or LARS's trust ratios), the whole model (LBFGS) or keeps per-tensor scalars.

The state each parameter gets is learned from one step of a *probe*: the same class over a
one-element tensor per group, with the group's settings (:func:`state_templates`); a layout
then makes that state explicit and zero from step 0 (what torch's lazy initialisation gives,
as the data-parallel layout's does), as views of flat buffers where the layout wants them
(``flat_shards.ShardedParameters``: the torch optimizer updates them in place).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from toolkit import ToolkitError
from toolkit.errors import describe

ELEMENTWISE = ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adamax", "RAdam", "Adadelta")
REFUSED = {
    "LBFGS": "it re-evaluates the loss through a closure and searches along the whole "
             "gradient",
    "SparseAdam": "it takes sparse gradients",
    "Adafactor": "it factors each matrix's second moment into its row and column means",
    "NAdam": "it keeps a per-tensor scalar (mu_product) that a shard does not carry",
    "ASGD": "it keeps per-tensor scalars (eta, mu) that a shard does not carry",
    "Rprop": "its step sizes start at the learning rate, not from zero state",
}
WORKS = ("torch.optim." + ", torch.optim.".join(ELEMENTWISE) + " (with any torch.optim."
         "lr_scheduler), or toolkit.SGD/toolkit.Adam")


def check_elementwise(torch, optimizer: Any, backend: str, layout: str) -> None:
    """A ToolkitError unless ``optimizer`` is a torch.optim optimizer this layout can run
    exactly on the parameters' pieces each rank holds (its exact class: a subclass may
    change the update)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ToolkitError(f"under a {layout} layout {backend} cannot use the optimizer "
                           f"{describe(optimizer)}", f"pass one of {WORKS}")
    name = type(optimizer).__name__
    if type(optimizer) is getattr(torch.optim, name, None) and name in ELEMENTWISE:
        return
    why = REFUSED.get(name, "it is not one of the torch.optim optimizers known to update "
                            "each element from that element alone")
    raise ToolkitError(f"under a {layout} layout {backend} cannot use the optimizer "
                       f"{describe(optimizer)}: {why}", f"use one of {WORKS}; or the "
                       "data-parallel layout, where every rank holds whole tensors")


def built_over(torch, optimizer: Any, params: list) -> Any:
    """``optimizer(params)`` when the user passed a function of the parameters (a factory, a
    ``functools.partial`` or an optimizer class); else ``optimizer`` as it is."""
    from toolkit import SGD, Adam

    if callable(optimizer) and not isinstance(optimizer, SGD | Adam | torch.optim.Optimizer):
        return optimizer(params)
    return optimizer


def state_templates(torch, optimizer: Any) -> list[dict[str, Any]]:
    """Per param group, the state torch gives one of its parameters: ``key -> value`` after a
    zero-gradient step of a probe (the same class and settings over a one-element tensor).
    A per-tensor scalar other than ``step`` is refused (a shard could not carry it)."""
    templates = []
    for group in optimizer.param_groups:
        like = group["params"][0] if group["params"] else torch.zeros(())
        probe = torch.zeros(1, dtype=like.dtype, device=like.device)
        settings = {k: v for k, v in group.items() if k != "params"}
        surrogate = type(optimizer)([{**settings, "params": [probe]}])
        probe.grad = torch.zeros_like(probe)
        surrogate.step()
        state = dict(surrogate.state.get(probe, {}))
        scalars = [k for k, v in state.items()
                   if k != "step" and not (torch.is_tensor(v) and v.shape == probe.shape)]
        if scalars:
            raise ToolkitError(f"the optimizer {type(optimizer).__name__} keeps the per-tensor "
                               f"state {scalars[0]!r}, which a layout's pieces cannot carry",
                               f"use one of {WORKS}")
        templates.append(state)
    return templates


def slot_names(templates: list[dict[str, Any]]) -> tuple[str, ...]:
    """The checkpoint's names (``opt/<name>/...``) of the per-element slots in ``templates``
    (:func:`state_templates`), every group's, each once."""
    from adapters.horovod_torch.ops import NEUTRAL_SLOTS

    return tuple(dict.fromkeys(NEUTRAL_SLOTS.get(k, k) for t in templates for k in t
                               if k != "step"))


def rebind(optimizer: Any, new: Callable[[Any], tuple[Any, Callable] | None]) -> None:
    """Replaces each parameter ``p`` of ``optimizer``'s groups, in place, by ``new(p)``'s
    tensor (``(tensor, take)``, ``take`` cutting a state tensor of ``p``'s shape to it), or
    drops it (None); state the optimizer already holds (Adagrad makes its own) moves with
    ``take``."""
    state = optimizer.state
    for group in optimizer.param_groups:
        kept = []
        for p in group["params"]:
            target = new(p)
            old = state.pop(p, None)
            if target is None:
                continue
            tensor, take = target
            if old:
                state[tensor] = {k: take(v) if k != "step" else v for k, v in old.items()}
            kept.append(tensor)
        group["params"] = kept


def fill_state(torch, optimizer: Any, templates: list[dict[str, Any]],
               slot: Callable[[Any, str], Any] | None = None) -> None:
    """Explicit state for every tensor of every group, from step 0: each per-element slot in
    ``slot(tensor, key)`` (a view of the layout's buffer; None: a new zero tensor), holding
    what the optimizer already had (Adagrad's initial sums) or zeros, and a zero step count
    where none is kept yet, in the form the probe's had (a tensor on its device, or a
    number)."""
    for group, template in zip(optimizer.param_groups, templates, strict=True):
        for t in group["params"]:
            have = optimizer.state[t]
            for key, value in template.items():
                old = have.get(key)
                if key == "step":
                    if old is None:
                        have[key] = (torch.zeros_like(value) if torch.is_tensor(value)
                                     else type(value)(0))
                    continue
                buf = slot(t, key) if slot is not None else torch.zeros_like(t)
                if old is not None:
                    buf.copy_(old)
                have[key] = buf


def step_count(torch, optimizer: Any) -> int | None:
    """The optimizer's step count (every tensor steps together), or None if it keeps none."""
    for state in optimizer.state.values():
        if "step" in state:
            return int(state["step"].item() if torch.is_tensor(state["step"]) else state["step"])
    return None


def set_step_count(torch, optimizer: Any, count: int) -> None:
    """Every tensor's ``step`` set to ``count``, each in the form it has."""
    from adapters.horovod_torch.ops import count_like

    for state in optimizer.state.values():
        if "step" in state:
            state["step"] = count_like(torch, state["step"], count)
