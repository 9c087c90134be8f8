"""Stages a file to node-local storage from every rank and reports what each rank got.

    <launcher> -np N python tests/scripts/staging_worker.py SOURCE [--local-dir DIR]
        [--rank0-delay SECONDS]

Every rank calls ``toolkit.datasets.stage`` (local rank 0 copies, the others wait), reads the
copy it was given through a memory map and emits (``_emit.py``) its rank, local and node rank,
host name, the path it got, that file's inode, the SHA-256 of what it read, and the time it
got the path back. ``--rank0-delay`` holds every node's local rank 0 back before it stages,
so that the other local ranks are sure to wait for it.
"""

from __future__ import annotations

import argparse
import hashlib
import socket
import time

import numpy as np
from _emit import emit

import toolkit
from toolkit.datasets import stage


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("source")
    p.add_argument("--local-dir", default=None)
    p.add_argument("--rank0-delay", type=float, default=0.0)
    args = p.parse_args()
    env = toolkit.current_env()
    if env.local_rank == 0:
        time.sleep(args.rank0_delay)
    called = time.time()
    local = stage(args.source, args.local_dir)
    returned = time.time()
    data = np.memmap(local, mode="r")
    emit({"rank": env.rank, "local_rank": env.local_rank, "node_rank": env.node_rank,
          "hostname": socket.gethostname(), "path": str(local), "ino": local.stat().st_ino,
          "sha256": hashlib.sha256(data).hexdigest(), "called": called,
          "returned": returned})


if __name__ == "__main__":
    toolkit.run(main)
