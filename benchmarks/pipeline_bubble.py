"""The measured pipeline bubble beside the formula, peak in-flight activations, and the step
time of each schedule relative to data parallel on the same processes.

    .venv/bin/horovodrun -np 2 --gloo .venv/bin/python benchmarks/pipeline_bubble.py \\
        --backend horovod-torch

S = 2 stages (one per process), M = ``--micro-batches``, on an MLP whose two halves have the
same number of parameters (``--width``, ``--layers`` hidden layers), SGD, random inputs (the
cost of a step does not depend on their values). For each schedule, every stage records when
each of its actions starts and ends (``TOOLKIT_PIPELINE_TIMELINE``); after ``--warmup`` steps,
rank 0 prints per step the idle fraction (1 - compute / (S x the step's span); waiting, sends
and receives count as idle), the formula (S-1)/(M+S-1), and the idle fraction the executor's rounds
would have with this step's measured forward and backward times per stage and free messages
(``toolkit.lockstep_idle_fraction``: what unequal stages alone explain; the rest is messages
and waiting on a shared machine). At S = 2 it equals the free-running stages' idle fraction
(``toolkit.simulate_schedule``), so it applies to the JAX executors' lockstep rounds and to
the Horovod executors' asynchronous ones alike. The median over steps is
the result. Then data parallel on the same processes for the step-time ratio.

On 2 CPU cores both stages share the machine with everything else running: measure on a quiet
machine, and read the ratios, not the absolute times.
"""

import argparse
import os
import shutil
import statistics
import tempfile
import time

import numpy as np

import adapters
import toolkit
from toolkit.parallel.pipeline.timeline import (
    TIMELINE_ENV,
    idle_fraction,
    peak_in_flight,
    select,
    stage_times,
)


def measure(records: list[dict], name: str, M: int, steps: range):
    """Median, min and max measured idle fraction over ``steps``, the median one the rounds
    would have with each step's measured stage times and free messages, the last step's peak
    in flight and stage times."""
    idle, equal = [], []
    for step in steps:
        picked = select(records, step)
        fwd, bwd = stage_times(picked, 2)
        idle.append(idle_fraction(picked))
        equal.append(toolkit.lockstep_idle_fraction(toolkit.pipeline_schedule(name, 2, M),
                                                    forward=fwd, backward=bwd))
    return (statistics.median(idle), min(idle), max(idle), statistics.median(equal),
            peak_in_flight(picked), fwd, bwd)


def run(backend: str, layout: str, model, batch: int, steps: int, folder: str | None):
    """Trains ``steps`` steps; returns the per-step seconds (every step timed on this rank)."""
    if folder:
        os.environ[TIMELINE_ENV] = folder
    else:
        os.environ.pop(TIMELINE_ENV, None)
    adapter = adapters.get(backend)
    seconds, real_step = [], adapter.train_step

    def timed(x, y, lr):
        start = time.perf_counter()
        loss = real_step(x, y, lr)
        float(loss)  # wait for the step (a JAX backend returns before its devices finish)
        seconds.append(time.perf_counter() - start)
        return loss

    adapter.train_step = timed
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * 4, model.sizes[0])).astype("float32")
    y = rng.integers(0, model.sizes[-1], size=batch * 4)
    toolkit.Trainer(adapter, model, toolkit.SGD(lr=1e-3), layout=layout, progress=False,
                    global_batch_size=batch, max_steps=steps).fit(x, y)
    adapter.barrier()  # every rank's timeline is written
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="horovod-torch")
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=512, help="global, in samples")
    # 4096: on this machine's cores a 2048-wide stage computes a micro-batch's forward and
    # backward in 6 + 18 ms, which a message's 1-2 ms (fixed, whatever its size) weighs on;
    # 4096-wide, 25 + 90 ms (the README gives both)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--layers", type=int, default=2,
                   help="width x width layers between the 64-wide input and the 10 classes "
                        "(even: equal stages)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--schedules", default="gpipe,1f1b")
    p.add_argument("--timeline-dir", default=os.path.join(tempfile.gettempdir(),
                                                          "pipeline-bubble"),
                   help="where the stages write their timelines (a folder both processes "
                        "see); "
                        "draw one with python -m toolkit.pipeline_timeline DIR/<schedule>")
    args = p.parse_args()
    env = toolkit.current_env()
    if env.world_size != 2:
        raise toolkit.ToolkitError(f"world size {env.world_size}: this benchmark cuts 2 stages "
                                   "(one per process)", "launch it with -np 2")
    width, M = args.width, args.micro_batches
    # 64 -> width, the square layers, width -> 10: the first stage's backward needs no input
    # gradient and the last stage's first layer is the square one, so an even number of
    # square layers gives both stages the same forward and backward work.
    model = toolkit.MLP((64,) + (width,) * (args.layers + 1) + (10,))
    formula = toolkit.bubble_formula("gpipe", 2, M)[1]
    toolkit.print0(f"{args.backend}: S = 2, M = {M}, MLP 64-{width} + {args.layers} x "
                   f"{width}x{width} + {width}-10, batch {args.batch_size}, {args.steps} steps "
                   f"(first {args.warmup} not counted); formula (S-1)/(M+S-1) = {formula:.3f}",
                   env=env)
    rows, step_time = [], {}
    for name in args.schedules.split(","):
        folder = os.path.join(args.timeline_dir, name)
        if env.rank == 0:  # before any step: no stage writes until both have started
            shutil.rmtree(folder, ignore_errors=True)
        seconds = run(args.backend, f"pipeline:2:{M}:{name}", model, args.batch_size,
                      args.steps, folder)
        step_time[name] = statistics.median(seconds[args.warmup:])
        if env.rank == 0:
            rows.append((name, *measure(toolkit.read_timeline([folder]), name, M,
                                        range(args.warmup, args.steps))))
    step_time["data"] = statistics.median(
        run(args.backend, "data", model, args.batch_size, args.steps, None)[args.warmup:])
    toolkit.print0("schedule  formula  measured idle (median, min-max)  with measured stage "
                   "times  peak in flight s0/s1  F / B ms per stage  step vs data parallel",
                   env=env)
    for name, med, lo, hi, sim, peak, fwd, bwd in rows:
        times = " ".join(f"{f * 1e3:.0f}/{b * 1e3:.0f}" for f, b in zip(fwd, bwd, strict=True))
        toolkit.print0(f"{name:9} {formula:.3f}    {med:.3f} ({lo:.3f}-{hi:.3f})"
                       f"{'':15}{sim:.3f}{'':18}{peak.get(0, 0)} / {peak.get(1, 0)}"
                       f"{'':14}{times:18}{step_time[name] / step_time['data']:.2f}x", env=env)
    toolkit.print0(f"data parallel: {step_time['data'] * 1e3:.0f} ms per step", env=env)


if __name__ == "__main__":
    toolkit.run(main)
