"""Step time of the update's modes side by side: plain float32, float32 that skips a step whose
gradient is not finite (``--on-nonfinite skip``), bf16-mixed, and fp16-mixed with its loss
scaler, on a tiny GPT, per layout, in one process.

    .venv/bin/python benchmarks/update_modes.py --backend jax-pjit
    .venv/bin/horovodrun -np 2 --gloo .venv/bin/python benchmarks/update_modes.py \\
        --backend horovod-tf --layouts data,sharded:3

Skipping and loss scaling decide each step on the gradient's norm: where that decision is read
on the host, a step waits for its device before the next is queued, which a plain step does
not. Where the layout's strategy keeps the decision on the device (``defers``:
``adapters/_update.py``), the modes marked "host" run the same step with the decision read on
the host after each step instead, side by side. Each mode is its own Trainer (built and
warmed up first); each window runs ``--steps`` steps of every mode in turn, the order rotating
between windows, so drift on a noisy machine hits them alike. Rank 0 prints each mode's
median ms/step and the median of its per-window ratios to plain float32's.
"""

import argparse
import contextlib
import statistics
import time

import numpy as np
from _gpt import gpt_options, gpt_spec

import adapters
import toolkit
from adapters._backend import load
from toolkit.launch.env import detect_launch_env

MODES = {"32": {}, "32, skip": {"on_nonfinite": "skip"}, "bf16-mixed": {"precision": "bf16-mixed"},
         "fp16-mixed": {"precision": "fp16-mixed"}}
# the same modes with the decision read on the host each step (where the strategy defers it)
HOST_MODES = {"skip, host": MODES["32, skip"], "fp16, host": MODES["fp16-mixed"]}


@contextlib.contextmanager
def reading_on_the_host(strategy_class):
    """A build in this block makes an update rule that reads each step's skip on the host."""
    own = strategy_class.__dict__.get("defers")
    strategy_class.defers = False
    try:
        yield
    finally:
        if own is None:
            del strategy_class.defers  # (inherited again)
        else:
            strategy_class.defers = own


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="horovod-torch", choices=adapters.BACKENDS)
    p.add_argument("--layouts", default="data,sharded:3")
    p.add_argument("--steps", type=int, default=10, help="steps per mode per window")
    p.add_argument("--windows", type=int, default=5)
    p.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto")
    gpt_options(p, context=32, batch=8)
    p.set_defaults(layers=2, width=64)
    args = p.parse_args()
    env = detect_launch_env()
    spec = gpt_spec(args)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, size=(args.batch * 8, args.context + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    toolkit.print0(f"{args.backend}, world {env.world_size}, GPT {spec.num_params:,} params, "
                   f"batch {args.batch}x{args.context}", env=env)
    toolkit.print0(f"{'layout':<11} {'mode':<11} {'ms/step':>8} {'vs 32':>6}", env=env)
    for layout in args.layouts.split(","):
        strategy_class = load(adapters.get(args.backend).strategies[
            toolkit.parse_layout(layout).kind])
        trainers = {}
        modes = dict(MODES)
        for mode, options in [*MODES.items(), *HOST_MODES.items()]:
            if mode in HOST_MODES:  # (only where the plain modes keep the skip on the device)
                if not trainers["32, skip"].adapter.strategy.rule.deferred:
                    continue
                modes[mode] = options
            options = dict(options)
            adapter = adapters.get(args.backend, precision=options.pop("precision", None))
            trainers[mode] = toolkit.Trainer(
                adapter, spec, toolkit.Adam(lr=1e-3), layout=layout,
                global_batch_size=args.batch, max_steps=3, progress=False, env=env,
                device=args.device, **options)
            with (reading_on_the_host(strategy_class) if mode in HOST_MODES
                  else contextlib.nullcontext()):
                trainers[mode].fit(x, y)  # (build, compile, warm up)
        seconds = {mode: [] for mode in modes}
        order = list(modes)
        for window in range(args.windows):
            for mode in order[window % len(order):] + order[:window % len(order)]:
                trainer = trainers[mode]
                start = time.perf_counter()
                trainer.max_steps += args.steps
                trainer.fit(x, y)
                seconds[mode].append(time.perf_counter() - start)
        if len(modes) == len(MODES):
            toolkit.print0(f"{layout}: read on the host after every step (the strategy does not "
                           "keep the skip on the device)", env=env)
        for mode in modes:
            ratio = statistics.median(a / b for a, b in zip(seconds[mode], seconds["32"],
                                                            strict=True))
            ms = statistics.median(seconds[mode]) / args.steps * 1e3
            toolkit.print0(f"{layout:<11} {mode:<11} {ms:8.1f} {ratio:6.2f}", env=env)


if __name__ == "__main__":
    main()
