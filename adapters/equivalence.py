"""The cross-framework equivalence check: same model, data, seed and optimizer in every
backend, at any world size, against a one-process float64 numpy reference.

    python -m adapters.equivalence                       # all backends, world sizes 1 and 2
    python -m adapters.equivalence --world-sizes 1,2,4 --dtype float64 --json eq.json
    python -m adapters.equivalence --backends horovod-torch,jax-pjit --plot curves.png

Each backend trains ``--steps`` steps on scikit-learn's digits with the model and optimizer
presets of ``toolkit.equivalence_problem``, launched by the chosen launcher (``--launcher
auto``: srun inside a Slurm allocation, else mpirun, else horovodrun; see
:func:`pick_launcher`). The table shows, for
every run, the final loss, the largest relative per-step loss deviation from the reference, the
largest absolute parameter deviation after the last step, the median time per step, and
PASS/FAIL. A backend that is not
installed is reported as SKIPPED with the reason, never as passed. The exit status is 1 when
any run fails.

The runs happen in worker processes (``python -m adapters.equivalence_worker``), so this
module imports no framework; it lives in ``adapters`` because it launches the backends (their
registry gives ``--backends``), and judges each run with ``toolkit.equivalence``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from adapters import BACKENDS
from toolkit.equivalence import (
    EARLY_TOLERANCE,
    LOSS_TOLERANCE,
    PARAM_TOLERANCE,
    compare,
    format_table,
    plot,
)
from toolkit.equivalence_problem import make_model, make_optimizer, reference
from toolkit.errors import ToolkitError
from toolkit.launch.devices import DEVICES
from toolkit.models.reference import check_clip
from toolkit.parallel.layouts import parse_layout
from toolkit.precision import Precision

LAUNCHERS = ("auto", "horovodrun", "mpirun", "srun")


def pick_launcher(requested: str) -> str:
    """``auto``: srun inside a Slurm allocation, else mpirun when it is on PATH, else
    horovodrun. mpirun is preferred to horovodrun because horovodrun first checks its own
    build by importing horovod.tensorflow (all of TensorFlow) in a forked process, for every
    launch, where mpirun starts the ranks at once."""
    if requested != "auto":
        return requested
    if "SLURM_JOB_ID" in os.environ:
        return "srun"
    return "mpirun" if shutil.which("mpirun") else "horovodrun"


def worker_command(args, backend: str, world_size: int, launcher: str, out: Path) -> list[str]:
    worker = [sys.executable, "-m", "adapters.equivalence_worker", "--backend", backend,
              "--model", args.model, "--optimizer", args.optimizer, "--steps", str(args.steps),
              "--batch-size", str(args.batch_size), "--dtype", args.dtype,
              "--seed", str(args.seed), "--layout", ",".join(args.layouts), "--out", str(out)]
    if args.precision is not None:
        worker += ["--precision", args.precision]
    if args.clip_grad_norm is not None:
        worker += ["--clip-grad-norm", repr(args.clip_grad_norm)]
    if args.device != "auto":
        worker += ["--device", args.device]
    if args.local_devices and backend.startswith("jax-"):
        worker += ["--local-devices", str(args.local_devices)]
    if world_size == 1 and launcher != "srun":  # (inside an allocation, a lone process
        return worker                             # must be a step of it, as srun -n 1 makes)
    if launcher == "horovodrun":
        exe = shutil.which("horovodrun") or str(Path(sys.executable).parent / "horovodrun")
        return [exe, "-np", str(world_size), "--gloo", *worker]
    if launcher == "mpirun":
        root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
        return ["mpirun", *root, "--oversubscribe", "-np", str(world_size), *worker]
    return ["srun", "-n", str(world_size), "--mpi=pmix", "--kill-on-bad-exit=1", *worker]


def run_one(args, backend: str, world_size: int, launcher: str, workdir: Path) -> list[dict]:
    """One launch of ``backend`` on ``world_size`` ranks, running every layout in turn; a
    result per layout."""
    out = workdir / f"{backend}-{world_size}"
    out.mkdir(parents=True, exist_ok=True)
    cmd = worker_command(args, backend, world_size, launcher, out)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
    used = "python" if world_size == 1 and launcher != "srun" else launcher
    bases = [{"backend": backend, "world_size": world_size, "launcher": used, "layout": layout}
             for layout in args.layouts]
    timeout = args.timeout * len(args.layouts)
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
        failure = None
    except FileNotFoundError as err:
        return [{**b, "status": "skipped", "reason": f"launcher not found: {err.filename}"}
                for b in bases]
    except subprocess.TimeoutExpired:
        proc, failure = None, f"timed out after {timeout:g} s"
    results = []
    for i, base in enumerate(bases):
        result_file = out / str(i) / "result.json"
        if not result_file.exists():
            if failure is None:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                failure = f"exit {proc.returncode}: " + " | ".join(tail)
            results.append({**base, "status": "fail", "reason": failure})
            continue
        result = {**base, **json.loads(result_file.read_text())}
        if result["status"] == "ok":
            with np.load(out / str(i) / "params.npz") as f:
                result["params"] = {k: f[k] for k in f.files}
        results.append(result)
    return results


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m adapters.equivalence",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated")
    p.add_argument("--world-sizes", default="1,2", help="comma-separated, e.g. 1,2,4")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=64, help="global batch")
    p.add_argument("--dtype", choices=("float32", "float64"), default=None,
                   help="the parameters' dtype (default float32)")
    p.add_argument("--precision", choices=("32", "64", "bf16-mixed", "fp16-mixed"),
                   default=None, help="bf16-mixed, fp16-mixed: the runs in bfloat16 (float16 "
                   "with loss scaling) against the reference of the same rounded arithmetic "
                   "(docs/precision.md)")
    p.add_argument("--model", default="mlp", help="mlp, cnn or gpt")
    p.add_argument("--optimizer", default="sgd", help="sgd, sgd-cosine, adam or adamw")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--launcher", choices=LAUNCHERS, default="auto")
    p.add_argument("--layout", default="data",
                   help="data, sharded:1|2|3, pipeline:S:M[:schedule], or several of them "
                        "comma-separated (run one after another in each launch); every layout "
                        "is compared with the same one-process reference")
    p.add_argument("--local-devices", type=int, default=None,
                   help="CPU devices per process for the JAX backends")
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="where the runs compute (auto: a GPU per rank where the framework "
                        "sees one); on a GPU, float32 matrix products run in full float32 "
                        "(no TF32), as the reference's")
    p.add_argument("--timeout", type=float, default=600, help="seconds per run")
    p.add_argument("--clip-grad-norm", type=float, default=None,
                   help="clip each step's gradient to this global norm (every run and the "
                        "reference); the norms before clipping are compared too")
    p.add_argument("--json", default=None, help="write all numbers to this file")
    p.add_argument("--plot", default=None, help="write the loss curves to this PNG")
    args = p.parse_args(argv)
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    for b in args.backends:
        if b not in BACKENDS:
            raise ToolkitError(f"unknown backend {b!r}", f"valid backends: {', '.join(BACKENDS)}")
    try:
        args.world_sizes = [int(w) for w in args.world_sizes.split(",")]
    except ValueError:
        raise ToolkitError(f"--world-sizes {args.world_sizes!r} is not a list of integers",
                           "write e.g. --world-sizes 1,2,4") from None
    for w in args.world_sizes:
        if w < 1 or args.batch_size % w:
            raise ToolkitError(f"world size {w} does not divide the global batch "
                               f"{args.batch_size}", "choose world sizes that divide --batch-size")
    policy = Precision.of(args.precision, args.dtype)
    args.dtype = policy.param_dtype
    args.bounds = policy.name if policy.mixed else args.dtype  # the tolerances' key
    if policy.mixed and args.model != "mlp":
        raise ToolkitError(f"the {policy.name} reference rounds the MLP only, not --model "
                           f"{args.model}", f"use --model mlp with --precision {policy.name}")
    make_model(args.model)
    make_optimizer(args.optimizer, args.steps)
    check_clip(args.clip_grad_norm)
    args.layouts = [parse_layout(name).name for name in args.layout.split(",")]
    args.layout = ",".join(args.layouts)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    launcher = pick_launcher(args.launcher)
    ref_norms: list[float] = []
    ref_losses, ref_params = reference(args, ref_norms)
    refs = {((1, 1), 1.0): (ref_losses, ref_params)}  # mixed: by the runs' batch splits
    clip = args.clip_grad_norm
    rows = []
    with tempfile.TemporaryDirectory(prefix="equivalence-") as tmp:
        for backend in args.backends:
            for world_size in args.world_sizes:
                for result in run_one(args, backend, world_size, launcher, Path(tmp)):
                    mixed = args.bounds in EARLY_TOLERANCE
                    split = ((tuple(result.get("data_split", (1, 1))),
                              result.get("part_weight", 1.0)) if mixed else ((1, 1), 1.0))
                    if split not in refs:
                        refs[split] = reference(args, split=split[0], part_weight=split[1])
                    rows.append(compare(result, *refs[split], args.bounds,
                                        ref_norms if clip is not None else None))
                    print(f"  ran {backend} x{world_size} {result['layout']}: "
                          f"{rows[-1]['status']}", file=sys.stderr, flush=True)
    baseline = {(r["world_size"], r["layout"]): r["step_seconds"] for r in rows
                if r["backend"] == args.backends[0] and "final_loss" in r}
    described = (f"numpy float32 parameters in {args.bounds[:4]} arithmetic rounded as the "
                 "runs round (each batch split as a run's devices split it)"
                 if args.bounds in EARLY_TOLERANCE else "numpy float64")
    print(f"equivalence: {args.model} + {args.optimizer}, layout {args.layout}, {args.steps} "
          f"steps, global batch "
          f"{args.batch_size}, {args.bounds}, seed {args.seed}; reference: {described}, "
          f"1 process; bounds: loss {LOSS_TOLERANCE[args.bounds]:.0e} relative, params "
          f"{PARAM_TOLERANCE[args.bounds]:.0e} absolute"
          + (f", the first {EARLY_TOLERANCE[args.bounds][0]} steps' losses "
             f"{EARLY_TOLERANCE[args.bounds][1]:.0e} relative"
             if args.bounds in EARLY_TOLERANCE else ""))
    if clip is not None:
        clipped = sum(n > clip for n in ref_norms)
        print(f"clip_grad_norm {clip:g}: the reference clipped {clipped} of {len(ref_norms)} "
              f"steps ({clipped / len(ref_norms):.0%}); each run's norms before clipping are "
              f"held to the loss bound")
    print(format_table(rows, baseline))
    if args.json:
        config = {k: v for k, v in vars(args).items() if k not in ("json", "plot")}
        config["reference_grad_norms"] = ref_norms
        Path(args.json).write_text(json.dumps(
            {"config": {**config, "launcher": launcher},
             "tolerance": {"loss": LOSS_TOLERANCE[args.bounds],
                           "params": PARAM_TOLERANCE[args.bounds]},
             "reference": {"losses": ref_losses}, "results": rows}, indent=1))
    if args.plot:
        plot(args.plot, ref_losses, rows)
    return 1 if any(r["status"] == "fail" for r in rows) else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ToolkitError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
