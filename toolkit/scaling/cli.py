"""``python -m toolkit.scaling``: the options, then one study per backend."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from toolkit.errors import ToolkitError
from toolkit.scaling.report import draw, table
from toolkit.scaling.study import ranks_per_node, run_study, study_label


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    import toolkit.scaling

    argv = list(sys.argv[1:] if argv is None else argv)
    script_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="python -m toolkit.scaling",
                                description=toolkit.scaling.__doc__.split("\n")[0])
    p.add_argument("--script", required=True, help="a training script taking --steps, "
                   "--batch-size (the global batch) and --metrics-log")
    p.add_argument("--world-sizes", default="1,2", help="comma-separated, e.g. 1,2,4")
    p.add_argument("--mode", choices=("strong", "weak"), default="strong")
    p.add_argument("--launcher", choices=("mpirun", "horovodrun", "srun"), default="mpirun")
    p.add_argument("--backend", default=None, help="passed to the script; several "
                   "(comma-separated) run one study each, drawn on one picture")
    p.add_argument("--layout", default=None, help="passed to the script")
    p.add_argument("--batch-size", type=int, default=None, help="strong: the global batch; "
                   "weak: the batch per rank (default: the script's --batch-size in "
                   "SCRIPT_ARGS)")
    p.add_argument("--steps", type=int, default=30, help="steps measured, after the warm-up")
    p.add_argument("--warmup", type=int, default=10, help="steps run first, not measured")
    p.add_argument("--no-breakdown", dest="breakdown", action="store_false",
                   help="no one-rank reference runs: no compute / comm+sync split")
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
    args.backends = [b.strip() for b in args.backend.split(",")] if args.backend else [None]
    if "" in args.backends or len(set(args.backends)) < len(args.backends):
        raise ToolkitError(f"--backend {args.backend!r} names an empty or repeated backend",
                           "e.g. --backend horovod-torch,jax-pjit")
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
    say = lambda text: print(text, flush=True)  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="scaling-") as tmp:
        out = Path(args.out_dir or tmp)
        batch = ("the script's default global batch" if not args.batch_size else
                 f"global batch {args.batch_size}" if args.mode == "strong" else
                 f"batch {args.batch_size} per rank")
        on = f" on {args.backend}" if args.backend else ""
        layout = f", layout {args.layout}" if args.layout else ""
        title = (f"{args.mode} scaling of {args.script}{on}{layout} under {args.launcher}, "
                 f"{batch}, {args.steps} steps after {args.warmup}")
        say(title)
        studies = {}
        for backend in args.backends:
            where = out / backend if len(args.backends) > 1 else out
            where.mkdir(parents=True, exist_ok=True)
            if len(args.backends) > 1:
                say(f"{backend}:")
            points = run_study(args, backend, where, per_node, environ, say)
            studies[study_label(backend, points)] = points
        for label, points in studies.items():
            if len(studies) > 1:
                say(f"\n{label}")
            say(table(points))
        if args.png:
            draw(studies, args.png, args.mode, title)
            say(f"plot: {args.png}")
    ok = any(p.status == "ok" for points in studies.values() for p in points)
    return 0 if ok else 1
