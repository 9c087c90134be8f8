"""A run's metrics log (the JSON lines rank 0 writes with ``--metrics-log``), read back.

Logs written before the Trainer wrote ``interval`` and ``eval`` records still read: the
throughput is then derived from the step records' times and the global batch, and the
validation losses come from the ``epoch`` records.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from toolkit.errors import ToolkitError


@dataclass
class MetricsFile:
    """One run's records: ``start`` (the start record, ``{}`` if none), the step records'
    ``steps``/``losses``/``times`` (arrays), ``evals`` ([(step, time, val_loss)]: the
    periodic ones), ``finals`` (the same, of an evaluation marked final: often over more
    data), ``intervals`` and ``prefetch`` (records)."""

    path: Path
    start: dict
    steps: np.ndarray
    losses: np.ndarray
    times: np.ndarray
    evals: list[tuple[int, float, float]] = field(default_factory=list)
    finals: list[tuple[int, float, float]] = field(default_factory=list)
    intervals: list[dict] = field(default_factory=list)
    prefetch: list[dict] = field(default_factory=list)

    @property
    def t0(self) -> float:
        """The run's start: its start record's time, else its first record's."""
        return float(self.start.get("time", self.times[0]))

    @property
    def label(self) -> str:
        """backend, precision and world size, as the start record names them."""
        s = self.start
        if not s:
            return self.path.stem
        precision = s.get("precision") or ""
        if precision in ("", "32", "64"):  # no mixed precision: the parameters' dtype says it
            precision = s.get("dtype") or precision
        return f"{s.get('backend', '?')} {precision} x{s.get('world_size', '?')}".replace(
            "  ", " ")

    @property
    def tokens_per_sample(self) -> int | None:
        """The context of a sequence model, when the log says it (interval records with
        tokens/s and samples/s, or a start record's ``context``)."""
        for r in self.intervals:
            if r.get("tokens_per_s") and r.get("samples_per_s"):
                return round(r["tokens_per_s"] / r["samples_per_s"])
        context = self.start.get("context")
        return int(context) if context else None

    def flushes(self, within: float = 0.02) -> tuple[np.ndarray, np.ndarray]:
        """(last step, time) of each write of step records, the start record's (start_step,
        time) first when there is one. Several steps may share one write, and one write's
        records may straddle a millisecond: times ``within`` seconds of a write's first are
        that write (so per-step times come in groups of that length)."""
        pairs = sorted(zip(self.steps.tolist(), self.times.tolist(), strict=True))
        if self.start.get("time") is not None and pairs and self.start["time"] < pairs[0][1]:
            pairs.insert(0, (int(self.start.get("start_step") or 0), self.start["time"]))
        out: list[list[float]] = []
        first = -np.inf
        for step, t in pairs:
            if out and t - first <= within:
                out[-1] = [step, t]
            else:
                out.append([step, t])
                first = t
        arr = np.asarray(out, dtype=float).reshape(-1, 2)
        return arr[:, 0], arr[:, 1]

    def throughput(self, max_points: int = 60) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                        str]:
        """(steps, seconds since the start, rate, unit): tokens/s or samples/s, from the
        interval records when there are any, else from the step records' times and the
        start record's global batch (empty arrays when neither says it)."""
        if self.intervals:
            key = "tokens_per_s" if any(r.get("tokens_per_s") for r in self.intervals) \
                else "samples_per_s"
            rows = [(r["step"], r["time"] - self.t0, r[key]) for r in self.intervals
                    if r.get(key) is not None]
            a = np.asarray(rows, dtype=float).reshape(-1, 3)
            return a[:, 0], a[:, 1], a[:, 2], key.replace("_per_s", "/s")
        batch = self.start.get("global_batch")
        steps, times = self.flushes()
        if not batch or len(steps) < 2:
            return np.zeros(0), np.zeros(0), np.zeros(0), "samples/s"
        keep = np.unique(np.linspace(0, len(steps) - 1, min(len(steps), max_points + 1))
                         .round().astype(int))
        steps, times = steps[keep], times[keep]
        dt, ds = np.diff(times), np.diff(steps)
        # a window in which the run evaluated measures the evaluation too: left out
        evals = np.asarray([t for _, t, _ in self.evals + self.finals])
        ok = (dt > 0) & ~np.array([bool(np.any((evals > a + 0.02) & (evals < b - 0.02)))
                                   for a, b in zip(times[:-1], times[1:], strict=True)],
                                  dtype=bool).reshape(dt.shape)
        rate = ds[ok] * batch / dt[ok]
        unit = "samples/s"
        if self.tokens_per_sample:
            rate, unit = rate * self.tokens_per_sample, "tokens/s"
        return steps[1:][ok], times[1:][ok] - self.t0, rate, unit


def read_metrics(path: str | Path) -> MetricsFile:
    """The records of the metrics log at ``path``; a ToolkitError naming the file when it is
    missing, not JSON lines, or has no step records."""
    path = Path(path)
    if not path.is_file():
        raise ToolkitError(f"metrics log {str(path)!r} does not exist",
                           "write one with the training script's --metrics-log FILE")
    start: dict = {}
    steps, evals, finals, intervals, prefetch = [], [], [], [], []
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as err:
            if number == len(lines):
                continue  # a run killed while writing its last line
            raise ToolkitError(f"{str(path)!r} line {number} is not JSON ({err.msg})",
                               "give a metrics log written with --metrics-log") from None
        event = r.get("event") if isinstance(r, dict) else None
        if event == "start" and not start:
            start = r
        elif event == "step" and "loss" in r:
            steps.append((r["step"], r["loss"], r["time"]))
        elif event in ("eval", "epoch") and r.get("val_loss") is not None:
            (finals if r.get("final") else evals).append(
                (int(r["step"]), float(r["time"]), float(r["val_loss"])))
        elif event == "interval":
            intervals.append(r)
        elif event == "prefetch":
            prefetch.append(r)
    if not steps:
        raise ToolkitError(f"metrics log {str(path)!r} has no step records",
                           "is it a metrics log (--metrics-log) of a run that took at "
                           "least one step?")
    a = np.asarray(steps, dtype=float)
    return MetricsFile(path, start, a[:, 0].astype(int), a[:, 1], a[:, 2], sorted(evals),
                       sorted(finals), intervals, prefetch)
