"""Checkpoint write/read throughput for a 100 MB state, beside plain numpy in the same run,
and the training-step slowdown while an asynchronous save runs.

    .venv/bin/python benchmarks/checkpoint_throughput.py [--mb 100] [--repeats 5] [--steps 40]

Ratios are what to read: this machine is shared and noisy, so every variant runs in the same
process, interleaved, and medians are reported.
"""

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

import adapters
import toolkit


def state_of(mb: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    n = 25
    per = mb * 2**20 // 4 // n
    return {f"params/w{i}": rng.standard_normal(per, dtype=np.float32) for i in range(n)}


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def plain_save(state, folder: Path, fsync: bool) -> None:
    folder.mkdir(exist_ok=True)
    for name, a in state.items():
        with open(folder / (name.replace("/", "_") + ".npy"), "wb") as f:
            np.save(f, a)
            if fsync:
                f.flush()
                os.fsync(f.fileno())


def plain_load(state, folder: Path) -> None:
    for name in state:
        np.load(folder / (name.replace("/", "_") + ".npy"))


def step_slowdown(state, tmp: Path, steps: int = 40) -> tuple[float, float, int]:
    """Median step time of a real horovod-torch step, alone and during an async save."""
    adapter = adapters.get("horovod-torch")
    adapter.setup(toolkit.LaunchEnv())
    adapter.build(toolkit.MLP((64, 1024, 1024, 10)), toolkit.SGD(lr=0.01), "cross_entropy")
    rng = np.random.default_rng(0)
    x, y = rng.random((256, 64), np.float32), rng.integers(0, 10, 256)
    for _ in range(5):
        adapter.train_step(x, y, 0.01)
    alone = [timed(lambda: adapter.train_step(x, y, 0.01)) for _ in range(steps)]
    store = toolkit.CheckpointStore(tmp / "async", keep=2)
    during = []
    # save returns the checkpoint's final path at once; the background write renames its
    # finished directory to that path, so the steps run until it exists.
    final = store.save(1, state, {}, blocking=False)
    while not final.exists():
        during.append(timed(lambda: adapter.train_step(x, y, 0.01)))
    store.wait()
    return statistics.median(alone), statistics.median(during or [float("nan")]), len(during)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=int, default=100)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=40, help="training steps timed alone")
    args = p.parse_args()
    state = state_of(args.mb)
    mb = sum(a.nbytes for a in state.values()) / 2**20
    times: dict[str, list[float]] = {k: [] for k in (
        "toolkit save", "np.save", "np.save+fsync", "toolkit load", "np.load")}
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        tmp = Path(tmp)
        store = toolkit.CheckpointStore(tmp / "store", keep=2)
        for r in range(args.repeats):
            times["toolkit save"].append(timed(lambda r=r: store.save(r, state, {"step": r})))
            times["np.save"].append(timed(lambda: plain_save(state, tmp / "plain", False)))
            times["np.save+fsync"].append(timed(lambda: plain_save(state, tmp / "plainf", True)))
            times["toolkit load"].append(timed(lambda: store.load("latest")))
            times["np.load"].append(timed(lambda: plain_load(state, tmp / "plain")))
        alone, during, n = step_slowdown(state, tmp, args.steps)
    print(f"state: {mb:.0f} MB in {len(state)} float32 arrays; median of {args.repeats} runs")
    for k, v in times.items():
        med = statistics.median(v)
        print(f"  {k:14s} {med * 1e3:8.1f} ms  {mb / med:8.0f} MB/s")
    save, load = (statistics.median(times[k]) for k in ("toolkit save", "toolkit load"))
    print(f"  toolkit save / np.save+fsync: {save / statistics.median(times['np.save+fsync']):.2f}x"
          f" time; toolkit load / np.load: {load / statistics.median(times['np.load']):.2f}x time")
    print(f"training step (horovod-torch MLP 64-1024-1024-10, batch 256): {alone * 1e3:.2f} ms "
          f"alone, {during * 1e3:.2f} ms during an async save ({n} steps): "
          f"{during / alone:.2f}x")


if __name__ == "__main__":
    main()
