"""Draw a pipeline's timeline and print its idle (bubble) fraction beside the schedule's formula.

Measured (the JSON-lines files the stages' ``StageRecorder`` wrote, or their folder)::

    python -m toolkit.pipeline_timeline runs/timeline/ --png timeline.png --schedule 1f1b

Simulated (no run needed; forward 1, backward 2 time units per stage unless given)::

    python -m toolkit.pipeline_timeline --simulate --schedule 1f1b --stages 4 --micro-batches 8 \\
        --png 1f1b.png

One row per stage, a box per forward (blue) and backward (orange) labelled with its
micro-batch; the gaps are the bubble. The idle fraction is 1 - (time in forwards and
backwards) / (stages x the step's span): sends, receives and waiting count as idle.
"""

from __future__ import annotations

import argparse
import sys

from toolkit.errors import ToolkitError
from toolkit.parallel.layouts import SCHEDULES
from toolkit.parallel.pipeline.schedules import bubble_formula, pipeline_schedule
from toolkit.parallel.pipeline.simulation import simulate_schedule
from toolkit.parallel.pipeline.timeline import (
    idle_fraction,
    peak_in_flight,
    read_timeline,
    select,
    stage_times,
    write_timeline,
)

_COLORS = {"F": ((0.27, 0.45, 0.77), (0.62, 0.75, 0.93)),   # chunk 0 dark, chunk 1+ light
           "B": ((0.90, 0.49, 0.20), (0.98, 0.76, 0.55))}


def _shade(kind: str, chunk: int, chunks: int) -> tuple[float, float, float]:
    dark, light = _COLORS[kind]
    w = chunk / (chunks - 1) if chunks > 1 else 0.0
    return tuple(d + (lt - d) * w for d, lt in zip(dark, light, strict=True))


def draw_timeline(records: list[dict], path: str, title: str = "", unit: str = "s") -> None:
    """Writes the timeline of one step of one replica (``records``) as a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    stages = sorted({r["stage"] for r in records})
    chunks = max(r["chunk"] for r in records) + 1
    t0 = min(r["start"] for r in records)
    span = max(r["end"] for r in records) - t0 or 1.0
    fig_w = 13.0
    fig, ax = plt.subplots(figsize=(fig_w, 0.75 * len(stages) + 1.6), dpi=110)
    points_per_unit = 0.8 * fig_w * 72 / span  # roughly: the axes take 80% of the width
    for s in stages:
        ax.barh(s, span, left=0, height=0.8, color=(0.93, 0.93, 0.93), zorder=0)
    for r in records:
        kind, start, width = r["action"][0], r["start"] - t0, r["end"] - r["start"]
        if r["action"].startswith(("SEND", "RECV")):
            if width > 0:  # time spent in a send/receive: a thin grey strip under the row
                ax.barh(r["stage"] + 0.32, width, left=start, height=0.12,
                        color=(0.45, 0.45, 0.45), zorder=1)
            continue
        ax.barh(r["stage"], width, left=start, height=0.8, zorder=2,
                color=_shade(kind, r["chunk"], chunks), edgecolor="white", linewidth=0.8)
        label = str(r["micro_batch"])
        size = min(10.0, 0.9 * width * points_per_unit / max(1, len(label)) / 0.62)
        if size >= 5:
            ax.text(start + width / 2, r["stage"], label, ha="center", va="center",
                    fontsize=size, color="white" if r["chunk"] == 0 else "black", zorder=3)
    ax.set_yticks(stages, [f"stage {s}" for s in stages])
    ax.set_ylim(max(stages) + 0.6, min(stages) - 0.6)  # stage 0 on top
    ax.set_xlim(0, span)
    ax.set_xlabel(f"time ({unit})")
    first = ", chunk 0" if chunks > 1 else ""
    handles = [Patch(color=_shade("F", 0, chunks), label="forward" + first),
               Patch(color=_shade("B", 0, chunks), label="backward" + first),
               Patch(color=(0.93, 0.93, 0.93), label="idle")]
    if chunks > 1:
        handles[2:2] = [Patch(color=_shade("F", chunks - 1, chunks),
                              label=f"forward, chunk {chunks - 1}"),
                        Patch(color=_shade("B", chunks - 1, chunks),
                              label=f"backward, chunk {chunks - 1}")]
    if any(r["action"].startswith(("SEND", "RECV")) and r["end"] > r["start"] for r in records):
        handles.append(Patch(color=(0.45, 0.45, 0.45), label="in a send / receive"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), frameon=False)
    ax.set_title(title, fontsize=11)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.tight_layout(rect=(0, 0.35 / (0.75 * len(stages) + 1.6), 1, 1))
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m toolkit.pipeline_timeline",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="*", help="timeline .jsonl files, or folders of them")
    parser.add_argument("--png", help="write the timeline picture here")
    parser.add_argument("--schedule", choices=SCHEDULES, help="the schedule that ran")
    parser.add_argument("--stages", type=int, help="S (default: from the records)")
    parser.add_argument("--micro-batches", type=int, help="M (default: from the records)")
    parser.add_argument("--chunks", type=int, help="v, for interleaved-1f1b")
    parser.add_argument("--step", type=int, help="which step to show (default: the last)")
    parser.add_argument("--replica", type=int, default=0, help="which replica to show")
    parser.add_argument("--simulate", action="store_true",
                        help="draw the simulator's timeline instead of a measured one")
    parser.add_argument("--forward", type=float, default=1.0, help="simulated forward time")
    parser.add_argument("--backward", type=float, help="simulated backward (default 2x)")
    parser.add_argument("--comm", type=float, default=0.0, help="simulated message time")
    parser.add_argument("--blocking", action="store_true",
                        help="simulate blocking (rendezvous) sends instead of buffered ones")
    parser.add_argument("--jsonl", help="with --simulate: also write the records here")
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except ToolkitError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def _many(n: int, noun: str, plural: str | None = None) -> str:
    """``1 stage``, ``4 stages``: a count with its noun in agreement."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def _run(args) -> int:
    if args.simulate:
        if args.runs or not (args.schedule and args.stages and args.micro_batches):
            raise ToolkitError("--simulate needs --schedule, --stages and --micro-batches and "
                               "no run files", "e.g. --simulate --schedule 1f1b --stages 4 "
                               "--micro-batches 8")
        schedule = pipeline_schedule(args.schedule, args.stages, args.micro_batches,
                                     args.chunks or 1)
        sim = simulate_schedule(schedule, args.forward, args.backward, args.comm, args.blocking)
        records, what, unit = sim.records(), "simulated", "units"
        if args.jsonl:
            write_timeline(records, args.jsonl)
    elif args.runs:
        records = select(read_timeline(args.runs), args.step, args.replica)
        what, unit = "measured", "s"
    else:
        raise ToolkitError("no timeline to show", "pass the run's .jsonl files (or folder), "
                           "or --simulate --schedule 1f1b --stages 4 --micro-batches 8")
    stages = args.stages or len({r["stage"] for r in records})
    micro = args.micro_batches or len({r["micro_batch"] for r in records})
    chunks = args.chunks or max(r["chunk"] for r in records) + 1
    name = args.schedule or ("interleaved-1f1b" if chunks > 1 else None)
    measured = idle_fraction(records)
    text, value = bubble_formula(name or "1f1b", stages, micro, chunks)
    label = name or "gpipe/1f1b"
    shape = (f"{_many(stages, 'stage')} x {_many(micro, 'micro-batch', 'micro-batches')}"
             + (f" x {chunks} chunks" if chunks > 1 else ""))
    print(f"schedule {label}: {shape}, replica {args.replica}")
    print(f"idle fraction: {what} {measured:.4f}, formula {text} = {value:.4f}")
    if name and not args.simulate:  # the same schedule simulated with the measured times
        f, b = stage_times(records, stages, chunks)
        if all(f) and all(b):
            sim = simulate_schedule(pipeline_schedule(name, stages, micro, chunks), f, b)
            print(f"idle fraction simulated with the measured stage times: "
                  f"{sim.idle_fraction:.4f}")
    peaks = peak_in_flight(records)
    print("peak in-flight activations per stage: " + " ".join(str(peaks[s]) for s in peaks))
    if args.png:
        title = (f"{label}: {shape} ({what}); idle {measured:.1%}, formula {text} = "
                 f"{value:.1%}")
        draw_timeline(records, args.png, title, unit)
        print(f"timeline: {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
