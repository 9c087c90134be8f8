"""What listening for stop signals costs per step: one tiny allreduce so that all ranks agree.

    .venv/bin/horovodrun -np 2 --gloo .venv/bin/python benchmarks/stop_signal_overhead.py \
        [BACKEND ...] [--steps 300] [--repeats 3]

For each backend (every one by default), trains the digits MLP without stop-signal handlers and
with them (ranks agreeing every step, and every 10 steps, the default), interleaved, ``--repeats``
times each over ``--steps`` timed steps, and prints (rank 0) the median time per step and the
ratios.
"""

import statistics
import tempfile
import time

import adapters
import toolkit
from toolkit.datasets import load_digits


def per_step(adapter, signals, every=1, steps=300) -> float:
    (x, y), _ = load_digits()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = toolkit.Trainer(adapter, toolkit.MLP((64, 128, 10)), toolkit.SGD(lr=0.05),
                                  global_batch_size=64, max_steps=steps, progress=False,
                                  checkpoint_dir=tmp, checkpoint_every=10**9,
                                  stop_signals=signals, stop_check_every=every)
        trainer.fit(x, y)  # warm-up (compilation) and set-up
        start = time.perf_counter()
        trainer.max_steps = 2 * steps
        trainer.fit(x, y)
        return (time.perf_counter() - start) / steps


SIGNALS = ("SIGUSR1", "SIGTERM")


def main() -> None:
    p = toolkit.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("backends", nargs="*", metavar="BACKEND",
                   help=f"any of {', '.join(adapters.BACKENDS)} (default: all)")
    p.add_argument("--steps", type=int, default=300, help="timed steps per run")
    p.add_argument("--repeats", type=int, default=3, help="runs of each variant")
    args = p.parse_args()
    unknown = [b for b in args.backends if b not in adapters.BACKENDS]
    if unknown:  # (checked here: argparse's choices reject an empty list of positionals)
        p.error(f"unknown backend {', '.join(unknown)}: choose from "
                f"{', '.join(adapters.BACKENDS)}")
    for backend in args.backends or adapters.BACKENDS:
        adapter = adapters.get(backend)
        runs: dict[str, list[float]] = {"none": [], "every 1": [], "every 10": []}
        for _ in range(args.repeats):
            runs["none"].append(per_step(adapter, (), steps=args.steps))
            runs["every 1"].append(per_step(adapter, SIGNALS, every=1, steps=args.steps))
            runs["every 10"].append(per_step(adapter, SIGNALS, every=10, steps=args.steps))
        base = statistics.median(runs["none"])
        toolkit.print0(f"{backend:14s} world {toolkit.current_env().world_size}: "
                       f"{base * 1e3:.3f} ms/step without handlers; " + ", ".join(
                           f"checking {k}: {statistics.median(v) / base:.2f}x"
                           for k, v in runs.items() if k != "none"))


if __name__ == "__main__":
    toolkit.run(main)
