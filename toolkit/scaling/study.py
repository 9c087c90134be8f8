"""The study's runs: one per world size (and one reference run of one rank per batch per rank,
for the step-time split), measured from their metrics logs."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from toolkit.errors import ToolkitError
from toolkit.metrics_file import MetricsFile, read_metrics


@dataclass
class Point:
    """One world size's result: ``status`` "ok" or why not; the rest None when it failed.

    ``compute_s`` is the step time of one rank given the same batch per rank (less its input
    wait), ``comm_s`` what this size's step adds to it (collectives, synchronisation), both
    None without a reference run."""

    world_size: int
    nodes: int
    status: str = "ok"
    throughput: float | None = None  # samples/s or tokens/s (``unit``)
    unit: str = "samples/s"
    step_s: float | None = None
    input_wait_s: float | None = None
    speedup: float | None = None
    efficiency: float | None = None
    compute_s: float | None = None
    comm_s: float | None = None
    batch_per_rank: int | None = None
    backend: str | None = None  # as the run's start record names them
    layout: str | None = None


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
    """(throughput, unit, seconds per step, input wait per step) after ``warmup`` steps.

    The seconds per step are the intervals' wall time per step (the global batch over the
    samples/s), not their median step time: under JAX's asynchronous dispatch that is the time
    to dispatch a step, while the interval's wall time ends when its last step is done."""
    after = [r for r in log.intervals if r.get("step", 0) > warmup]
    if after:
        key = "tokens_per_s" if after[0].get("tokens_per_s") else "samples_per_s"
        weights = np.asarray([r.get("steps", 1) for r in after], dtype=float)
        rate = float(np.average([r[key] for r in after], weights=weights))
        batch = log.start.get("global_batch")
        step = float(np.average([batch / r["samples_per_s"] if batch else
                                 r.get("step_time_s") or np.nan for r in after],
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


def run_size(args, backend: str | None, world_size: int, nodes: int, out: Path,
             batch: int | None, name: str) -> Point:
    """Runs the script on ``world_size`` ranks with global batch ``batch`` (None: the
    script's), its log and output ``out/NAME.jsonl|.out``; the measured :class:`Point`."""
    log = out / f"{name}.jsonl"
    log.unlink(missing_ok=True)
    script_args = list(args.script_args)
    if batch:
        script_args = [*_without(script_args, "--batch-size"), "--batch-size", str(batch)]
    for option, value in (("backend", backend), ("layout", args.layout)):
        if value:
            script_args = [*_without(script_args, f"--{option}"), f"--{option}", value]
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
    (out / f"{name}.out").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        point.status = f"exit {proc.returncode}: {last_error(proc.stderr)[:120]}"
        return point
    try:
        metrics = read_metrics(log)
        point.throughput, point.unit, point.step_s, point.input_wait_s = measure(
            metrics, args.warmup)
        point.nodes = int(metrics.start.get("nodes") or nodes)
        point.backend, point.layout = metrics.start.get("backend"), metrics.start.get("layout")
        global_batch = metrics.start.get("global_batch")
        if global_batch and global_batch % world_size == 0:
            point.batch_per_rank = global_batch // world_size
    except ToolkitError as err:
        point.status = err.message
    return point


def run_study(args, backend: str | None, out: Path, per_node: int | None,
              environ: dict, say=print) -> list[Point]:
    """Every world size of the study for one backend (``say`` reports each as it ends), then
    the reference runs that split the step time (unless ``args.breakdown`` is off)."""
    points = []
    for n in args.sizes:
        batch = args.batch_size and args.batch_size * (n if args.mode == "weak" else 1)
        points.append(run_size(args, backend, n, nodes_for(n, args.launcher, per_node, environ),
                               out, batch, f"world{n}"))
        say(f"  N={n}: {points[-1].status}")
    fill_ratios(points)
    if args.breakdown:
        references: dict[int, Point] = {p.batch_per_rank: p for p in points
                                        if p.world_size == 1 and p.step_s}
        for b in sorted({p.batch_per_rank for p in points if p.step_s} - set(references)):
            if b:
                references[b] = run_size(args, backend, 1, 1, out, b, f"reference{b}")
                say(f"  one rank at batch {b} (compute time): {references[b].status}")
        split_step_time(points, references)
    return points


def split_step_time(points: list[Point], references: dict[int, Point]) -> None:
    """Each point's compute (its one-rank reference's step less input wait) and the rest of
    its step less input wait (communication and synchronisation).

    Example:
        >>> p = Point(2, 1, step_s=0.30, input_wait_s=0.01, batch_per_rank=16)
        >>> split_step_time([p], {16: Point(1, 1, step_s=0.21, input_wait_s=0.01)})
        >>> round(p.compute_s, 3), round(p.comm_s, 3)
        (0.2, 0.09)
    """
    for p in points:
        ref = references.get(p.batch_per_rank)
        if p.step_s is None or ref is None or ref.step_s is None:
            continue
        p.compute_s = ref.step_s - (ref.input_wait_s or 0.0)
        p.comm_s = 0.0 if ref is p else p.step_s - (p.input_wait_s or 0.0) - p.compute_s


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


def study_label(backend: str | None, points: list[Point]) -> str:
    """The legend's name of a study: its backend and layout as its runs' start records name
    them (a script's defaults included), else as asked.

    Example:
        >>> study_label(None, [Point(1, 1, backend="jax-pjit", layout="data")])
        'jax-pjit, data'
    """
    named = next((p for p in points if p.backend), None)
    if named is None:
        return backend or "the script's default backend"
    return f"{named.backend}, {named.layout}" if named.layout else named.backend
