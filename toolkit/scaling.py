"""A strong or weak scaling study of a training script: throughput, speed-up and efficiency
against the number of ranks, as a table and a PNG.

    python -m toolkit.scaling --script examples/train_gpt.py --world-sizes 1,2,4 \\
        --mode strong|weak [--launcher mpirun|horovodrun|srun] [--steps 30 --warmup 10] \\
        [--png scaling.png] -- SCRIPT_ARGS

Each world size runs the script with the launcher for ``--warmup`` + ``--steps`` steps, its
metrics log in ``--out-dir``; the throughput is that of the steps after the warm-up (the
``interval`` records when the log has them, else the step records' times). Strong scaling
keeps the global batch (the script's ``--batch-size``); weak scaling keeps the batch per rank,
the global batch growing with the world size. Speed-up is the throughput over that of the
smallest size (times that size), efficiency the speed-up over the world size: for weak
scaling, the throughput per rank relative to the smallest size's.

Under ``srun`` inside an allocation of several nodes, the ranks fill one node before the next
(``--ranks-per-node``, else the allocation's cores per node) and the table and the picture
mark where the job first spans another node. A size that fails is reported in the table and
the study goes on; the exit status is non-zero only when every size failed.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from toolkit.errors import ToolkitError
from toolkit.metrics_file import MetricsFile, read_metrics


@dataclass
class Point:
    """One world size's result: ``status`` "ok" or why not; the rest None when it failed."""

    world_size: int
    nodes: int
    status: str = "ok"
    throughput: float | None = None  # samples/s or tokens/s (``unit``)
    unit: str = "samples/s"
    step_s: float | None = None
    input_wait_s: float | None = None
    speedup: float | None = None
    efficiency: float | None = None


def ranks_per_node(given: int | None, environ: dict) -> int | None:
    """Ranks that fill a node: ``given``, else the job's tasks per node, else its CPUs on its
    first node (SLURM_NTASKS_PER_NODE, SLURM_JOB_CPUS_PER_NODE: ``"4(x2)"``, ``"4,2"``, ``"4"``).

    Example:
        >>> ranks_per_node(None, {"SLURM_JOB_CPUS_PER_NODE": "8(x2)"})
        8
    """
    if given:
        return given
    match = re.match(r"(\d+)", environ.get("SLURM_NTASKS_PER_NODE")
                     or environ.get("SLURM_JOB_CPUS_PER_NODE", ""))
    return int(match.group(1)) if match else None


def nodes_for(world_size: int, launcher: str, per_node: int | None, environ: dict) -> int:
    """Nodes a world size spans: under srun in a multi-node allocation, ranks fill nodes."""
    allocated = int(environ.get("SLURM_JOB_NUM_NODES") or 1)
    if launcher != "srun" or allocated < 2 or not per_node:
        return 1
    return min(allocated, math.ceil(world_size / per_node))


def launch_command(launcher: str, world_size: int, nodes: int, argv: list[str]) -> list[str]:
    """The launcher's command line for ``python argv...`` on ``world_size`` ranks."""
    py = [sys.executable, *argv]
    if launcher == "mpirun":
        extra = ["--allow-run-as-root"] if os.geteuid() == 0 else []
        if world_size > (os.cpu_count() or 1):
            extra.append("--oversubscribe")
        return ["mpirun", *extra, "-np", str(world_size), *py]
    if launcher == "horovodrun":
        return [str(Path(sys.executable).parent / "horovodrun"), "-np", str(world_size), *py]
    if launcher == "srun":
        return ["srun", "-N", str(nodes), "-n", str(world_size), "--distribution=block",
                "--mpi=pmix", "--kill-on-bad-exit=1", *py]
    if launcher == "python":
        return py
    raise ToolkitError(f"unknown launcher {launcher!r}", "use mpirun, horovodrun or srun")


def measure(log: MetricsFile, warmup: int) -> tuple[float, str, float, float | None]:
    """(throughput, unit, seconds per step, input wait per step) after ``warmup`` steps."""
    after = [r for r in log.intervals if r.get("step", 0) > warmup]
    if after:
        key = "tokens_per_s" if after[0].get("tokens_per_s") else "samples_per_s"
        weights = np.asarray([r.get("steps", 1) for r in after], dtype=float)
        rate = float(np.average([r[key] for r in after], weights=weights))
        step = float(np.average([r.get("step_time_s") or np.nan for r in after],
                                weights=weights))
        waits = [r.get("input_wait_s") for r in after if r.get("input_wait_s") is not None]
        return rate, key.replace("_per_s", "/s"), step, float(np.mean(waits)) if waits \
            else None
    steps, times = log.flushes()
    first = int(np.searchsorted(steps, warmup))
    if first >= len(steps) - 1 or times[-1] <= times[first]:
        raise ToolkitError(f"{log.path}: no timed steps after the {warmup} warm-up steps "
                           f"(the log's steps are timed at {sorted(set(steps.tolist()))[:8]})",
                           "run more --steps, or fewer --warmup")
    n, seconds = steps[-1] - steps[first], times[-1] - times[first]
    # logs without interval records: the wait of the whole run (one prefetch record per fit)
    batches = sum(r.get("batches") or 0 for r in log.prefetch)
    wait = sum(r.get("wait_seconds") or 0.0 for r in log.prefetch) / batches if batches \
        else None
    return float(n * log.start["global_batch"] / seconds), "samples/s", float(seconds / n), wait


def run_size(args, world_size: int, nodes: int, out: Path) -> Point:
    log = out / f"world{world_size}.jsonl"
    log.unlink(missing_ok=True)
    script_args = list(args.script_args)
    if args.batch_size:
        batch = args.batch_size * (world_size if args.mode == "weak" else 1)
        script_args = [*_without(script_args, "--batch-size"), "--batch-size", str(batch)]
    for option in ("backend", "layout"):
        if getattr(args, option):
            script_args = [*_without(script_args, f"--{option}"), f"--{option}",
                           getattr(args, option)]
    argv = [args.script, *_without(script_args, "--steps"), "--steps",
            str(args.warmup + args.steps), "--metrics-log", str(log)]
    point = Point(world_size, nodes)
    try:
        proc = subprocess.run(launch_command(args.launcher, world_size, nodes, argv),
                              capture_output=True, text=True, timeout=args.timeout,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        point.status = f"timed out after {args.timeout:.0f} s"
        return point
    (out / f"world{world_size}.out").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        point.status = f"exit {proc.returncode}: {last_error(proc.stderr)[:120]}"
        return point
    try:
        metrics = read_metrics(log)
        point.throughput, point.unit, point.step_s, point.input_wait_s = measure(
            metrics, args.warmup)
        point.nodes = int(metrics.start.get("nodes") or nodes)
    except ToolkitError as err:
        point.status = err.message
    return point


def last_error(stderr: str) -> str:
    """The last line of ``stderr`` that names an error, else its last line that is not a
    launcher's frame of dashes.

    Example:
        >>> last_error("error: bad batch\\nHINT: change it\\n-----\\nmpirun: job aborted\\n")
        'error: bad batch'
    """
    lines = [x.strip() for x in stderr.splitlines() if x.strip().strip("-=*")]
    errors = [x for x in lines if re.search(r"\berror\b|Error\b|Exception\b", x)]
    return (errors or lines or ["(no stderr)"])[-1]


def _without(args: list[str], option: str) -> list[str]:
    """``args`` less ``option`` and its value (``--option v`` or ``--option=v``)."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == option:
            skip = True
        elif not a.startswith(option + "="):
            out.append(a)
    return out


def fill_ratios(points: list[Point]) -> None:
    """Speed-up and efficiency of each measured point against the smallest measured size."""
    ok = [p for p in points if p.throughput]
    if not ok:
        return
    base = min(ok, key=lambda p: p.world_size)
    for p in ok:
        p.speedup = base.world_size * p.throughput / base.throughput
        p.efficiency = p.speedup / p.world_size


def boundaries(points: list[Point]) -> list[int]:
    """The world sizes at which the job first spans more nodes than the size before."""
    return [b.world_size for a, b in zip(points, points[1:], strict=False) if b.nodes > a.nodes]


def table(points: list[Point]) -> str:
    """The study's table, one row per world size."""
    unit = next((p.unit for p in points if p.throughput), "samples/s")
    cross = set(boundaries(points))
    rows = [("N", "nodes", unit, "speed-up", "efficiency", "step ms", "input wait ms",
             "status")]
    f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for p in points:
        rows.append((str(p.world_size), str(p.nodes) + (" *" if p.world_size in cross else ""),
                     f(p.throughput, ".1f"), f(p.speedup, ".2f"), f(p.efficiency, ".2f"),
                     f(p.step_s and p.step_s * 1e3, ".2f"),
                     f(p.input_wait_s and p.input_wait_s * 1e3, ".3f"), p.status))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    text = "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in rows)
    if cross:
        text += "\n* the job spans another node from this size on"
    return text


def draw(points: list[Point], png: str, mode: str, title: str):
    """Speed-up against the ideal line, and efficiency, into ``png``; returns the Figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [p for p in points if p.speedup is not None]
    n = np.asarray([p.world_size for p in ok])
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    sizes = [p.world_size for p in points]
    left.plot(sizes, sizes, "k--", lw=1, alpha=0.5, label="ideal")
    left.plot(n, [p.speedup for p in ok], "o-", label="measured")
    right.axhline(1.0, color="k", ls="--", lw=1, alpha=0.5, label="ideal")
    right.plot(n, [p.efficiency for p in ok], "o-", color="C1", label="measured")
    for ax in (left, right):
        for b in boundaries(points):
            ax.axvline(b - 0.5, color="C3", ls=":", lw=1.5)
            ax.text(b - 0.5, ax.get_ylim()[1], " next node", color="C3", va="top", fontsize=8)
        for p in points:
            if p.status != "ok":
                ax.axvline(p.world_size, color="0.6", lw=0.8)
                ax.text(p.world_size, ax.get_ylim()[0], "failed ", rotation=90, fontsize=8,
                        ha="right", color="0.4", va="bottom")
        ax.set_xticks(sizes)
        ax.set_xlabel("ranks (N)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    left.set(ylabel="speed-up", title=f"{mode} scaling: speed-up")
    right.set(ylabel="efficiency (speed-up / N)" if mode == "strong" else
              "efficiency (throughput per rank / N=1's)", title="efficiency")
    right.set_ylim(0, max([1.1, *[p.efficiency * 1.1 for p in ok]]))
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    return fig


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="python -m toolkit.scaling",
                                description=__doc__.split("\n")[0])
    p.add_argument("--script", required=True, help="a training script taking --steps, "
                   "--batch-size (the global batch) and --metrics-log")
    p.add_argument("--world-sizes", default="1,2", help="comma-separated, e.g. 1,2,4")
    p.add_argument("--mode", choices=("strong", "weak"), default="strong")
    p.add_argument("--launcher", choices=("mpirun", "horovodrun", "srun"), default="mpirun")
    p.add_argument("--backend", default=None, help="passed to the script")
    p.add_argument("--layout", default=None, help="passed to the script")
    p.add_argument("--batch-size", type=int, default=None, help="strong: the global batch; "
                   "weak: the batch per rank (default: the script's --batch-size in "
                   "SCRIPT_ARGS)")
    p.add_argument("--steps", type=int, default=30, help="steps measured, after the warm-up")
    p.add_argument("--warmup", type=int, default=10, help="steps run first, not measured")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="under srun: ranks that fill a node (default: the allocation's CPUs "
                        "per node)")
    p.add_argument("--out-dir", default=None, help="the runs' metrics logs and output "
                   "(default: a temporary folder)")
    p.add_argument("--png", default=None, help="draw speed-up and efficiency here")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per world size")
    args = p.parse_args(argv)
    args.script_args = script_args
    try:
        args.sizes = sorted({int(s) for s in args.world_sizes.split(",")})
    except ValueError:
        raise ToolkitError(f"--world-sizes {args.world_sizes!r} is not a list of integers",
                           "e.g. --world-sizes 1,2,4") from None
    if not args.sizes or min(args.sizes) < 1:
        raise ToolkitError(f"--world-sizes {args.world_sizes!r} must be positive integers",
                           "e.g. --world-sizes 1,2,4")
    if args.steps < 1 or args.warmup < 0:
        raise ToolkitError(f"--steps {args.steps} / --warmup {args.warmup}: at least one "
                           "measured step and no negative warm-up", "e.g. --steps 30 --warmup 10")
    if not Path(args.script).is_file():
        raise ToolkitError(f"--script {args.script!r} does not exist",
                           "give the path of a training script, e.g. examples/train_gpt.py")
    if args.batch_size is None and "--batch-size" in script_args:
        args.batch_size = int(script_args[script_args.index("--batch-size") + 1])
        if args.mode == "weak":
            raise ToolkitError(f"weak scaling with --batch-size {args.batch_size} after --: "
                               "is it per rank or global?",
                               "give the batch per rank as the study's own --batch-size")
    if args.mode == "weak" and not args.batch_size:
        raise ToolkitError("weak scaling needs the batch per rank",
                           "give it with --batch-size (the global batch grows with N)")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except ToolkitError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    environ = dict(os.environ)
    per_node = ranks_per_node(args.ranks_per_node, environ)
    with tempfile.TemporaryDirectory(prefix="scaling-") as tmp:
        out = Path(args.out_dir or tmp)
        out.mkdir(parents=True, exist_ok=True)
        batch = ("the script's default global batch" if not args.batch_size else
                 f"global batch {args.batch_size}" if args.mode == "strong" else
                 f"batch {args.batch_size} per rank")
        on = f" on {args.backend}" if args.backend else ""
        title = (f"{args.mode} scaling of {args.script}{on} under {args.launcher}, {batch}, "
                 f"{args.steps} steps after {args.warmup}")
        print(title, flush=True)
        points = []
        for n in args.sizes:
            points.append(run_size(args, n, nodes_for(n, args.launcher, per_node, environ),
                                   out))
            print(f"  N={n}: {points[-1].status}", flush=True)
        fill_ratios(points)
        print(table(points))
        if args.png:
            draw(points, args.png, args.mode, title)
            print(f"plot: {args.png}")
    return 0 if any(p.status == "ok" for p in points) else 1


if __name__ == "__main__":
    sys.exit(main())
