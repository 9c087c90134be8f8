"""Loss curves and throughput of one or more runs, from their metrics logs, as one PNG.

    python -m toolkit.plot run1.jsonl run2.jsonl --png curves.png [--x step|time] [--labels a,b]

The left panel shows each run's training loss (a smoothed line over the faint raw losses) and
its validation losses (markers: the ``eval`` and ``epoch`` records; a star for a final one)
against the step or the wall time since the run started; the right panel its throughput
(the ``interval`` records' tokens/s or samples/s, else derived from the step records' times
and the global batch; a window with an evaluation in it is left out).
Each run's label defaults to its backend, precision and world size (the start record).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from toolkit.errors import ToolkitError
from toolkit.metrics_file import MetricsFile, read_metrics


def smooth(values: np.ndarray, weight: float | None = None) -> np.ndarray:
    """An exponential moving average with its start-up bias removed (TensorBoard's smoothing);
    ``weight`` defaults to one that averages over about 1/30 of the run.

    Example:
        >>> smooth(np.array([1.0, 1.0, 4.0]), weight=0.5).round(3).tolist()
        [1.0, 1.0, 2.714]
    """
    if weight is None:
        weight = 1 - 1 / max(1.0, len(values) / 30)
    out, avg = np.empty(len(values)), 0.0
    for i, v in enumerate(values):
        avg = weight * avg + (1 - weight) * v
        out[i] = avg / (1 - weight ** (i + 1)) if weight < 1 else v
    return out


def step_seconds(run: MetricsFile) -> np.ndarray:
    """Each step's time since the run's start; where several steps share one write, spread
    evenly between that write and the one before (not a staircase)."""
    steps, times = run.flushes()
    return np.interp(run.steps, steps, times) - run.t0


def draw(runs: list[MetricsFile], png: str, x: str = "step",
         labels: list[str] | None = None):
    """Draws ``runs`` into ``png`` and returns the matplotlib Figure (its axes' lines hold
    the data drawn: the loss panel first, the throughput panel second)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = labels or [r.label for r in runs]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    units, runs_lines = set(), []
    for i, (run, label) in enumerate(zip(runs, labels, strict=True)):
        color = f"C{i % 10}"
        xs = run.steps if x == "step" else step_seconds(run)
        left.plot(xs, run.losses, color=color, lw=0.6, alpha=0.25)
        runs_lines += left.plot(xs, smooth(run.losses), color=color, lw=1.6,
                                label=f"{label} train")
        if run.evals:
            ev = np.asarray(run.evals)
            left.plot(ev[:, 0] if x == "step" else ev[:, 1] - run.t0, ev[:, 2], "o--",
                      color=color, ms=4, lw=1, label=f"{label} validation")
        if run.finals:
            ev = np.asarray(run.finals)
            left.plot(ev[:, 0] if x == "step" else ev[:, 1] - run.t0, ev[:, 2], "*",
                      color=color, ms=10, label=f"{label} final validation")
        steps, seconds, rate, unit = run.throughput()
        if len(rate):
            units.add(unit)
            right.plot(steps if x == "step" else seconds, rate, ".-", color=color, lw=1,
                       ms=3, label=label)
    xlabel = "step" if x == "step" else "wall time since the start (s)"
    left.set(xlabel=xlabel, ylabel="loss",
             title="training loss (lines); validation (dots; a star: final)")
    left.grid(alpha=0.3)
    if x == "step" and len(runs) > 1:
        differences(left, runs, labels)
    left.legend(handles=runs_lines, labels=labels, fontsize=8,
                loc="lower left" if x == "step" and len(runs) > 1 else "best")
    right.set(xlabel=xlabel, ylabel=" or ".join(sorted(units)) or "throughput",
              title="throughput")
    right.set_ylim(bottom=0)
    right.grid(alpha=0.3)
    if units:
        right.legend(fontsize=8)
    else:
        right.text(0.5, 0.5, "no throughput in these logs", ha="center",
                   transform=right.transAxes)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    return fig


def differences(ax, runs: list[MetricsFile], labels: list[str]):
    """An inset of ``ax``: each later run's smoothed training loss minus the first run's, at
    the steps both logged (runs that agree draw on top of each other in the main panel; here
    their gaps show). Returns the inset Axes."""
    inset = ax.inset_axes([0.45, 0.5, 0.52, 0.36])
    first = smooth(runs[0].losses)
    for i, run in enumerate(runs[1:], start=1):
        common, a, b = np.intersect1d(runs[0].steps, run.steps, return_indices=True)
        inset.plot(common, smooth(run.losses)[b] - first[a], color=f"C{i % 10}", lw=1,
                   label=labels[i])
    inset.axhline(0.0, color="C0", lw=0.8)
    inset.set_title(f"smoothed loss minus {labels[0]}'s", fontsize=8)
    inset.tick_params(labelsize=7)
    inset.grid(alpha=0.3)
    return inset


def summary(runs: list[MetricsFile], labels: list[str]) -> str:
    """One line per run: its label, steps, last training and validation loss, throughput."""
    rows = [("run", "steps", "final loss", "val loss", "throughput")]
    for run, label in zip(runs, labels, strict=True):
        _, _, rate, unit = run.throughput()
        rows.append((label, str(int(run.steps[-1])), f"{run.losses[-1]:.4f}",
                     f"{(run.finals or run.evals)[-1][2]:.4f}" if run.finals or run.evals
                     else "-",
                     f"{np.median(rate):,.0f} {unit}" if len(rate) else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m toolkit.plot", description=__doc__.split(
        "\n")[0])
    p.add_argument("logs", nargs="+", help="metrics logs (JSON lines, --metrics-log)")
    p.add_argument("--png", required=True, help="the picture to write")
    p.add_argument("--x", choices=("step", "time"), default="step",
                   help="the horizontal axis: the step, or the wall time since the start")
    p.add_argument("--labels", default=None, help="comma-separated, one per log")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        runs = [read_metrics(path) for path in args.logs]
        labels = args.labels.split(",") if args.labels else [r.label for r in runs]
        if len(labels) != len(runs):
            raise ToolkitError(f"--labels {args.labels!r} names {len(labels)} runs, but "
                               f"{len(runs)} logs were given",
                               "give one label per log, separated by commas")
        draw(runs, args.png, args.x, labels)
    except ToolkitError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(summary(runs, labels))
    print(f"plot: {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
