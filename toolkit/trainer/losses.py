"""Each step's loss on its way to the History: kept local (a framework scalar may still be in
flight) until the ranks average a batch of them in one allreduce, then logged and checked by
the divergence guard, in step order, with the same values on every rank."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from toolkit.contract import StepResult
from toolkit.trainer.guard import DivergenceGuard
from toolkit.trainer.history import History, MetricsLog
from toolkit.trainer.metrics import IntervalMeter
from toolkit.trainer.tensorboard import TensorBoardLog


class StepLosses:
    """The step losses (and gradient norms) of one ``fit`` not yet averaged across ranks;
    ``meter`` times them, ``tensorboard`` receives the records the log does."""

    def __init__(self, history: History, guard: DivergenceGuard, log: MetricsLog,
                 meter: IntervalMeter | None = None, tensorboard: TensorBoardLog | None = None):
        self.history, self.guard, self.log = history, guard, log
        self.meter, self.tensorboard = meter, tensorboard
        self.times: list[float | None] = []  # when each step was seen finished (wall clock)
        self.lrs: list[float | None] = []  # each step's learning rate, if known
        self.last_interval: dict[str, Any] | None = None  # the latest interval record
        self.pending: list[Any] = []  # local step losses not yet averaged across ranks
        self.norms: list[Any] = []  # their gradient norms (the same on every rank)
        # whether each step was skipped (on_nonfinite="skip") and, fp16, each step's (loss
        # scale, overflow): framework values that may still be on the device, read at the flush
        self.skipped: list[tuple[bool, Any, Any]] = []  # (the guard's to count, skipped, overflow)
        self.scales: list[tuple[Any, Any]] = []

    def add(self, step: StepResult, guard_skips: bool = False, lr: float | None = None) -> None:
        """A step's result; ``guard_skips``: its skips are the divergence guard's to count
        (``on_nonfinite="skip"``), a loss scaler's overflows never are; ``lr``: its learning
        rate (None: unknown)."""
        self.times.append(None)
        self.lrs.append(lr)
        self.pending.append(step.loss)
        self.skipped.append((guard_skips, step.skipped, step.overflow))
        if step.grad_norm is not None:
            self.norms.append(step.grad_norm)
        if step.loss_scale is not None:  # (a scale of 1.0 or below is still a scaler's)
            self.scales.append((step.loss_scale, step.overflow))
        self._see_finished()

    def _see_finished(self) -> None:
        """Notes the time of the steps now seen finished, without waiting: a plain value's step
        finished when it returned; a JAX value in flight (asynchronous dispatch) says when it
        is ready, and steps finish in order."""
        now = round(time.time(), 3)
        for i in range(len(self.pending)):
            if self.times[i] is None:
                ready = getattr(self.pending[i], "is_ready", None)
                if callable(ready) and not ready():
                    return
                self.times[i] = now

    def _wait(self, i: int) -> float:
        value = float(self.pending[i])
        if self.times[i] is None:
            self.times[i] = round(time.time(), 3)
        return value

    def __len__(self) -> int:
        return len(self.pending)

    def flush(self, step: int, allreduce: Callable | None) -> tuple[int, float, str] | None:
        """Averages the losses of the steps up to ``step`` across ranks (``allreduce``; None
        for one process), adds them to the History and the metrics log, and returns the
        guard's ``(step, loss, why)`` when one of them diverged."""
        pending, history = self.pending, self.history
        if not pending:
            return None
        # float() only here: train_step may return a framework scalar still in flight (the
        # step finished when float() returns, if it was not seen finished before).
        local = np.asarray([self._wait(i) for i in range(len(pending))], np.float64)
        # (one process: the mean over one rank is its own; Horovod's allreduce would still wait
        # out a cycle of its background thread, about 1 ms)
        averaged = allreduce(local, "mean") if allreduce is not None else local
        first = step - len(pending)
        history.losses.extend(float(v) for v in averaged)
        norms = [float(v) for v in self.norms] if len(self.norms) == len(pending) else []
        skipped = [guard and bool(s) and not bool(o) for guard, s, o in self.skipped]
        scales = [(float(s), bool(o)) for s, o in self.scales] \
            if len(self.scales) == len(pending) else []
        history.grad_norms.extend(norms)
        history.skipped_steps.extend(first + i + 1 for i, s in enumerate(skipped) if s)
        history.loss_scales.extend(s for s, _ in scales)
        history.overflow_steps.extend(first + i + 1 for i, (_, o) in enumerate(scales) if o)
        records = [{"event": "step", "step": first + i + 1, "loss": float(v),
                    "time": self.times[i],
                    **({"lr": self.lrs[i]} if self.lrs[i] is not None else {}),
                    **({"grad_norm": norms[i]} if norms else {}),
                    **({"skipped": True} if skipped[i] else {}),
                    **({"loss_scale": scales[i][0]} if scales else {}),
                    **({"overflow": True} if scales and scales[i][1] else {})}
                   for i, v in enumerate(averaged)]
        interval = self.meter.interval(step, self.lrs, norms, [s for s, _ in scales]) \
            if self.meter is not None else None
        if interval is not None:
            records.append({"time": round(time.time(), 3), **interval})
            self.last_interval = interval
        report(self.log, self.tensorboard, records)
        pending.clear()
        self.times.clear()
        self.lrs.clear()
        self.norms.clear()
        self.skipped.clear()
        self.scales.clear()
        return self.guard.check(first, averaged, norms, skipped, [o for _, o in scales])


def report(log: MetricsLog, tensorboard: TensorBoardLog | None, records: list[dict]) -> None:
    """``records`` to the metrics log and to TensorBoard (flushed)."""
    log.write(records)
    if tensorboard is not None:
        for record in records:
            tensorboard.write(record)
        tensorboard.flush()
