"""What rank 0 measures of the steps between two flushes (an *interval*): throughput, step
time, input wait, learning rate, gradient norm, loss scale and MFU, for the metrics log, the
printed line and TensorBoard.

Each step is timed at two points of the loop: its start (before its batch is loaded) and the
end of the load. A flush averages the step losses across ranks, which waits for every step of
the interval to finish on the device, so the interval's wall time (from its first step's start
to the flush) is exact under asynchronous dispatch too (JAX's steps return before the device
has finished them): throughput is ``steps x global batch / that time``. The step time is the
median of the times between consecutive step starts (the last step ending at the flush): with
synchronous steps (Horovod) the time of a step; under asynchronous dispatch the host may run
ahead of the device, and it is the dispatch time of most steps while the flush waits for the
rest, so read the throughput there. Time spent between intervals (an evaluation, a
checkpoint) belongs to neither.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from toolkit.models.flops import check_flops, device_peak, training_flops_per_sample


def _round(value: float) -> float:
    return float(f"{value:.6g}")


class IntervalMeter:
    """Times the steps of one interval and makes its record.

    Args:
        world_size: ranks in the run.
        global_batch: samples per step over all ranks.
        tokens_per_sample: the sequence length of a sequence model (tokens/s), else None.
        flops_per_sample: training FLOPs of one sample, None when unknown.
        peak_flops: peak FLOP/s of all the devices together, None when unknown.
        clock: seconds of a monotonic clock (tests give their own).
    """

    def __init__(self, world_size: int, global_batch: int, tokens_per_sample: int | None = None,
                 flops_per_sample: float | None = None, peak_flops: float | None = None,
                 clock=time.monotonic):
        self.world_size, self.global_batch = world_size, global_batch
        self.tokens_per_sample = tokens_per_sample
        self.flops_per_sample, self.peak_flops = flops_per_sample, peak_flops
        self.clock = clock
        self.starts: list[float] = []
        self.waits: list[float] = []

    def load(self, loader: Any, indices: Any) -> Any:
        """``loader.get(indices)``, timed: a step starts here."""
        start = self.clock()
        self.starts.append(start)
        batch = loader.get(indices)
        self.waits.append(self.clock() - start)
        return batch

    def interval(self, step: int, lrs: list, norms: list[float],
                 scales: list[float]) -> dict[str, Any] | None:
        """The interval record of the steps up to ``step`` (call after their flush): ``lrs``,
        ``norms``, ``scales``: each step's learning rate (None: unknown), gradient norm and
        loss scale, where they exist. None when no step was timed."""
        if not self.starts:
            return None
        end, steps = self.clock(), len(self.starts)
        wall = max(end - self.starts[0], 1e-9)
        bounds = [*self.starts, end]
        samples_per_s = steps * self.global_batch / wall
        record: dict[str, Any] = {
            "event": "interval", "step": step, "steps": steps, "world_size": self.world_size,
            "samples_per_s": _round(samples_per_s)}
        if self.tokens_per_sample:
            record["tokens_per_s"] = _round(samples_per_s * self.tokens_per_sample)
        record["step_time_s"] = _round(statistics.median(
            b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)))
        record["input_wait_s"] = _round(sum(self.waits) / len(self.waits))
        if lrs and lrs[-1] is not None:
            record["lr"] = lrs[-1]
        if norms:
            record["grad_norm"] = _round(sum(norms) / len(norms))  # the interval's mean
        if scales:
            record["loss_scale"] = scales[-1]
        record["mfu"] = (_round(self.flops_per_sample * samples_per_s / self.peak_flops)
                         if self.flops_per_sample and self.peak_flops else None)
        self.starts.clear()
        self.waits.clear()
        return record


def interval_line(record: dict[str, Any], loss: float) -> str:
    """Rank 0's line at a ``log_every`` step.

    Example:
        >>> interval_line({"step": 20, "samples_per_s": 2500.0, "step_time_s": 0.0251,
        ...                "input_wait_s": 0.0001, "lr": 0.05, "mfu": None}, 0.5)
        'step 20  loss 0.5000  lr 0.05  2,500 samples/s  step 25.1 ms  input 0.1 ms  mfu n/a'
    """
    line = f"step {record['step']}  loss {loss:.4f}"
    if "lr" in record:
        line += f"  lr {record['lr']:.4g}"
    if "samples_per_s" in record:
        line += f"  {record['samples_per_s']:,.0f} samples/s"
    if "tokens_per_s" in record:
        line += f" ({record['tokens_per_s']:,.0f} tokens/s)"
    if "step_time_s" in record:
        line += (f"  step {record['step_time_s'] * 1e3:.1f} ms"
                 f"  input {record['input_wait_s'] * 1e3:.1f} ms")
    if "grad_norm" in record:
        line += f"  grad_norm {record['grad_norm']:.4f}"
    if "loss_scale" in record:
        line += f"  loss_scale {record['loss_scale']:g}"
    if "mfu" in record:
        line += "  mfu n/a" if record["mfu"] is None else f"  mfu {record['mfu']:.1%}"
    return line


def native_lr(optimizer: Any) -> float | None:
    """The current learning rate of a framework's own optimizer, where it can be read without
    importing the framework: torch's ``param_groups[0]["lr"]``, Keras's ``learning_rate``
    (a schedule's current value); None otherwise (an optax transformation hides it). A torch
    ``(optimizer, scheduler)`` pair is read through its optimizer, which the scheduler moves."""
    if isinstance(optimizer, tuple | list) and optimizer:
        optimizer = optimizer[0]  # (an optax (init, update) pair's init has no groups: None)
    try:
        groups = getattr(optimizer, "param_groups", None)
        if groups:
            return float(groups[0]["lr"])
        value = getattr(optimizer, "learning_rate", None)
        if value is not None and not callable(value):
            import numpy as np

            return float(np.asarray(value))
    except Exception:  # an object of the user's that only looks like an optimizer
        return None
    return None


def tokens_per_sample(model: Any, data: Any) -> int | None:
    """The sequence length of a sequence model: the GPT spec's context, or the data set's
    (``toolkit.TokenWindows``) for a native model; None for others."""
    if type(model).__name__ == "GPT":
        return int(model.context)
    context = getattr(data, "context", None)
    return int(context) if isinstance(context, int) else None


def mfu_facts(model: Any, flops_per_sample: float | None, peak_flops: float | None,
              device_names: list[str], compute_dtype: str, devices: int) -> dict[str, Any]:
    """What the MFU is computed from, for the start record and the start-up block:
    ``flops_per_sample``, ``peak_flops`` (all devices together) and ``mfu_words`` (what they
    are, or why the MFU is left out)."""
    flops = check_flops("flops_per_sample", flops_per_sample)
    per_device = check_flops("peak_flops", peak_flops)
    from_spec = training_flops_per_sample(model)
    flops = flops if flops is not None else from_spec
    if per_device is not None:
        peak_words = f"{per_device / 1e12:g} TFLOP/s per device (given)"
    else:
        per_device, peak_words = device_peak(device_names, compute_dtype)
    if flops is None:
        words = ("n/a: the FLOPs of a native model are unknown; pass flops_per_sample= "
                 "(training FLOPs of one sample) for an MFU")
    elif per_device is None:
        words = f"n/a: {peak_words}"
    else:
        words = (f"{flops:,.0f} FLOPs per sample over {devices} x {peak_words}")
    return {"flops_per_sample": flops,
            "peak_flops": None if per_device is None else per_device * devices,
            "mfu_words": words}
