"""A torch learning-rate scheduler beside a native torch optimizer: ``optimizer=(opt, sched)``.

The scheduler is stepped after every optimizer step (torch's order) and its state is part of
the checkpoint under ``sched/...``: every number of ``scheduler.state_dict()`` (nested
schedulers of ``SequentialLR``/``ChainedScheduler`` included, by dotted path) and each param
group's current settings that a scheduler may move (``lr``, and ``betas`` or ``momentum`` that
``OneCycleLR`` cycles: every float or tuple of floats), so a resumed run continues the
schedule where it stopped. A
scheduler's functions (``LambdaLR``'s lambdas) are code, not state: the resumed run brings its
own, as it brings its model.
"""

from __future__ import annotations

from numbers import Number
from typing import Any

import numpy as np

from toolkit import ToolkitError
from toolkit.errors import describe


def split_scheduler(torch, optimizer: Any) -> tuple[Any, Any]:
    """``(optimizer, scheduler or None)`` from what the user passed as the optimizer."""
    if not isinstance(optimizer, tuple):
        return optimizer, None
    lr_scheduler = torch.optim.lr_scheduler
    if len(optimizer) != 2 or not isinstance(optimizer[1], lr_scheduler.LRScheduler):
        raise ToolkitError(
            f"horovod-torch got the optimizer tuple {describe(optimizer)}",
            "pass a torch.optim optimizer, or (optimizer, scheduler) with a "
            "torch.optim.lr_scheduler scheduler of that optimizer")
    opt, sched = optimizer
    if isinstance(sched, lr_scheduler.ReduceLROnPlateau):
        raise ToolkitError("ReduceLROnPlateau needs a validation metric at every step, which "
                           "the Trainer does not pass", "use a scheduler of the step count "
                           "(StepLR, LambdaLR, OneCycleLR, CosineAnnealingLR, SequentialLR...)")
    if sched.optimizer is not opt:
        raise ToolkitError(f"the scheduler {type(sched).__name__} schedules another optimizer "
                           f"than the {type(opt).__name__} given with it",
                           "build the scheduler over the optimizer you pass: "
                           "(opt, torch.optim.lr_scheduler.StepLR(opt, ...))")
    # Horovod's DistributedOptimizer is a new object over the same param-group dicts, so the
    # scheduler's lr changes reach it; its own step is the one that runs.
    opt._opt_called = True  # noqa: SLF001  torch's "optimizer.step() was called" flag
    return opt, sched


def _numbers(value: Any, path: str, out: dict[str, np.ndarray]) -> None:
    if isinstance(value, bool | Number) and not isinstance(value, complex):
        out[path] = np.asarray(value)
    elif isinstance(value, dict):
        for key, item in value.items():
            _numbers(item, f"{path}.{key}", out)
    elif isinstance(value, list | tuple):
        if value and all(isinstance(v, Number) for v in value):
            out[path] = np.asarray(value, np.float64)
        else:
            for i, item in enumerate(value):
                _numbers(item, f"{path}.{i}", out)


def scheduler_state(sched, optimizer) -> dict[str, np.ndarray]:
    """The scheduler's numbers and the param groups' learning rates, as named arrays."""
    out: dict[str, np.ndarray] = {}
    for key, value in sched.state_dict().items():
        _numbers(value, f"sched/{key}", out)
    for i, group in enumerate(optimizer.param_groups):
        for key, value in group.items():
            if isinstance(value, float) or (isinstance(value, tuple) and value
                                            and all(isinstance(v, float) for v in value)):
                out[f"sched/param_groups.{i}.{key}"] = np.asarray(value, np.float64)
    return out


def _restore(target: Any, parts: list[str], array: np.ndarray) -> Any:
    """``target`` with the value at ``parts`` replaced by ``array`` (of the old value's type)."""
    if not parts:
        if isinstance(target, list | tuple):  # each item keeps its type (int milestones)
            values = np.asarray(array).reshape(-1).tolist()
            return type(target)(type(old)(v) for old, v in zip(target, values, strict=True))
        return type(target)(np.asarray(array).item())
    key = parts[0]
    if isinstance(target, dict):
        target[key] = _restore(target[key], parts[1:], array)
        return target
    items = list(target)
    items[int(key)] = _restore(items[int(key)], parts[1:], array)
    return type(target)(items)


def load_scheduler_state(sched, optimizer, state: dict[str, np.ndarray]) -> None:
    """Puts :func:`scheduler_state`'s arrays back into the scheduler and the param groups."""
    current = sched.state_dict()
    expected = scheduler_state(sched, optimizer)
    missing = sorted(n for n in set(expected) - set(state)
                     if not n.startswith("sched/param_groups.") or n.endswith(".lr"))
    if missing:
        raise ToolkitError(f"the checkpoint lacks the scheduler state {missing[:3]}",
                           "resume with the scheduler the checkpoint was written with")
    for name in (n for n in expected if n in state):
        parts = name[len("sched/"):].split(".")
        if parts[0] == "param_groups":
            group, key = optimizer.param_groups[int(parts[1])], parts[2]
            group[key] = _restore(group[key], [], state[name])
        else:
            current = _restore(current, parts, state[name])
    sched.load_state_dict(current)
