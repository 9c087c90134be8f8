"""Re-reading a packed token corpus from the shared directory against reading the node-local copy
that ``toolkit.datasets.stage`` made of it; and what staging costs.

    .venv/bin/python benchmarks/staging.py --shared-dir /var/tmp --local-dir /dev/shm \
        [--mb 512] [--passes 5] [--batches 1000]

A corpus of ``--mb`` MB of random uint16 tokens is written (``.npy``) under ``--shared-dir`` and
staged under ``--local-dir`` (each in a temporary folder, removed at the end). Then, in
``--passes`` rounds whose order rotates, both files are read through a memory map, as
``TokenWindows`` reads them, in two patterns:

- sequential: every byte, 16 MB at a time (an epoch over the whole corpus);
- random windows: ``--batches`` batches of 32 windows of 1,024 tokens at random positions.

Each file is read twice per round: after dropping its pages from this machine's page cache
(``posix_fadvise(DONTNEED)``: the next read goes to the file system; a tmpfs keeps its pages,
so there it changes nothing) and again with them cached. The medians are printed, with the
ratio of an uncached shared read to an uncached local one, and how many such sequential passes
repay the copy.
"""

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from toolkit import LaunchEnv, TokenWindows
from toolkit.datasets import stage

CONTEXT, BATCH = 1024, 32


def file_system(path: Path) -> str:
    """``type on device`` of the mount that holds ``path`` (from /proc/mounts)."""
    best = ("", "?", "?")
    with open("/proc/mounts") as f:
        for line in f:
            device, mount, kind = line.split()[:3]
            if str(path).startswith(mount.rstrip("/") + "/") and len(mount) >= len(best[0]):
                best = (mount, kind, device)
    return f"{best[1]} on {best[2]}"


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def sequential(path: Path) -> float:
    tokens = np.load(path, mmap_mode="r")
    chunk = (16 << 20) // tokens.itemsize
    buffer = np.empty(chunk, tokens.dtype)
    start = time.perf_counter()
    for i in range(0, len(tokens), chunk):
        part = tokens[i:i + chunk]
        np.copyto(buffer[:len(part)], part)
    return time.perf_counter() - start


def random_windows(path: Path, batches: int, seed: int) -> float:
    data = TokenWindows(np.load(path, mmap_mode="r"), CONTEXT, vocab=1 << 16)
    order = np.random.default_rng(seed).integers(0, len(data), (batches, BATCH))
    start = time.perf_counter()
    for indices in order:
        data.batch(indices)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shared-dir", required=True, help="where the data set lives")
    p.add_argument("--local-dir", required=True, help="the node-local directory to stage to")
    p.add_argument("--mb", type=int, default=512, help="corpus size")
    p.add_argument("--passes", type=int, default=5, help="rounds of every read")
    p.add_argument("--batches", type=int, default=1000, help="random-window batches per read")
    args = p.parse_args()
    for folder in (args.shared_dir, args.local_dir):
        Path(folder).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.shared_dir, prefix="staging-bench-") as shared, \
            tempfile.TemporaryDirectory(dir=args.local_dir, prefix="staging-bench-") as local:
        source = Path(shared) / "corpus.npy"
        tokens = np.random.default_rng(0).integers(0, 1 << 16, args.mb * 10**6 // 2, np.uint16)
        with open(source, "wb") as f:
            np.save(f, tokens)
            f.flush()
            os.fsync(f.fileno())  # clean pages: the eviction can drop them
        del tokens
        evict(source)
        start = time.perf_counter()
        copy = stage(source, local, env=LaunchEnv())
        first = time.perf_counter() - start
        start = time.perf_counter()
        stage(source, local, env=LaunchEnv())
        check = time.perf_counter() - start
        runs = {(pattern, where, cached): [] for pattern in ("sequential", "random")
                for where in ("shared", "local") for cached in (False, True)}
        keys = list(runs)
        for r in range(args.passes):
            for pattern, where, cached in keys[r % len(keys):] + keys[:r % len(keys)]:
                path = source if where == "shared" else copy
                if not cached:
                    evict(path)
                else:  # cached: read once beforehand
                    sequential(path)
                runs[(pattern, where, cached)].append(
                    sequential(path) if pattern == "sequential"
                    else random_windows(path, args.batches, seed=r))
        mb = source.stat().st_size / 1e6
        print(f"corpus: {mb:,.0f} MB of uint16 tokens (.npy); shared {Path(shared).parent} "
              f"({file_system(Path(shared))}), local {Path(local).parent} "
              f"({file_system(Path(local))})")
        print(f"staging: first copy {first:.2f} s (read, write, sha256 of both); a re-run's "
              f"check {check:.2f} s (sha256 of the copy, nothing copied)")
        print(f"{'read (median of ' + str(args.passes) + ')':34s} {'shared, evicted':>16s} "
              f"{'shared, cached':>15s} {'local, evicted':>15s} {'local, cached':>14s} "
              f"{'shared / local, evicted':>24s}")
        label = {"sequential": f"sequential, {mb:,.0f} MB",
                 "random": f"random windows, {args.batches}x{BATCH}x{CONTEXT}"}
        for pattern in ("sequential", "random"):
            cells = {(w, c): statistics.median(runs[(pattern, w, c)])
                     for w in ("shared", "local") for c in (False, True)}
            print(f"{label[pattern]:34s} {cells[('shared', False)]:14.3f} s "
                  f"{cells[('shared', True)]:13.3f} s {cells[('local', False)]:13.3f} s "
                  f"{cells[('local', True)]:12.3f} s "
                  f"{cells[('shared', False)] / cells[('local', False)]:23.1f}x")
        seq = {w: statistics.median(runs[("sequential", w, False)]) for w in ("shared", "local")}
        saved = seq["shared"] - seq["local"]
        print(f"the first copy is repaid after {first / saved:.1f} sequential passes that would "
              "have read the shared file uncached" if saved > 0 else
              "an uncached sequential pass is no faster from the local copy")


if __name__ == "__main__":
    main()
