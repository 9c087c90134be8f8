"""What listening for stop signals costs per step: one tiny allreduce so that all ranks agree.

    .venv/bin/horovodrun -np 2 --gloo .venv/bin/python benchmarks/stop_signal_overhead.py

For each backend, trains the digits MLP with and without stop-signal handlers, interleaved,
and prints (rank 0) the median time per step of each and their ratio.
"""

import statistics
import sys
import tempfile
import time

import adapters
import toolkit
from toolkit.datasets import load_digits


def per_step(adapter, signals, steps=300) -> float:
    (x, y), _ = load_digits()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = toolkit.Trainer(adapter, toolkit.MLP((64, 128, 10)), toolkit.SGD(lr=0.05),
                                  global_batch_size=64, max_steps=steps, progress=False,
                                  checkpoint_dir=tmp, checkpoint_every=10**9,
                                  stop_signals=signals)
        trainer.fit(x, y)  # warm-up (compilation) and set-up
        start = time.perf_counter()
        trainer.max_steps = 2 * steps
        trainer.fit(x, y)
        return (time.perf_counter() - start) / steps


def main() -> None:
    backends = sys.argv[1:] or list(adapters.BACKENDS)
    for backend in backends:
        adapter = adapters.get(backend)
        without, with_ = [], []
        for _ in range(3):
            without.append(per_step(adapter, ()))
            with_.append(per_step(adapter, ("SIGUSR1", "SIGTERM")))
        a, b = statistics.median(without), statistics.median(with_)
        toolkit.print0(f"{backend:14s} world {toolkit.current_env().world_size}: "
                       f"{a * 1e3:.3f} ms/step without handlers, {b * 1e3:.3f} ms/step with: "
                       f"{b / a:.2f}x")


if __name__ == "__main__":
    toolkit.run(main)
