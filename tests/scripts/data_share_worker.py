"""Records which samples each process's devices train on, step by step, for every layout given.

    <launcher> -np N python tests/scripts/data_share_worker.py BACKEND LAYOUT[,LAYOUT...]
        [--local-devices L]

Each sample of the data set is recognisable from its row (a GPT's random token windows are
distinct), so what a step consumed is read from what the backend actually trains on: the
arrays ``train_step`` receives, and for a JAX global array the rows each of this process's
devices holds (``addressable_shards``), not the sampler's hand-out. Per step and layout every
rank emits (see ``_emit.py``):

- ``expected``: the samples its position in the layout calls for, from the sampler's published
  partition (``GlobalBatchSampler.global_batch`` cut by ``layout.data_share``);
- ``consumed``: the samples its devices hold, in order;
- ``pieces``: ``[start, stop, ids]`` per row range of a global array its devices hold (a
  host batch: one piece, the whole local batch), so the test can check that every process
  holding a piece of one global array holds the same samples there, and that the pieces
  cover the global batch exactly once.
"""

from __future__ import annotations

import argparse

import numpy as np
from _emit import emit

import adapters
import toolkit
from toolkit.contract import DrivesDevices
from toolkit.models.gpt import GPT

STEPS, BATCH = 2, 16


def data(n=64, vocab=32, context=8):
    rng = np.random.default_rng(7)
    x = rng.integers(0, vocab, (n, context))
    assert len({row.tobytes() for row in x}) == n  # every sample recognisable
    return x, rng.integers(0, vocab, (n, context))


def pieces_of(x) -> tuple[bool, list[tuple[int, int, np.ndarray]]]:
    """``(global, pieces)``: for a JAX global array, ``(start, stop, rows)`` of each distinct
    row range this process's devices hold (global row numbers); for a host batch, one piece."""
    if not hasattr(x, "addressable_shards"):
        rows = np.asarray(x)
        return False, [(0, len(rows), rows)]
    out = {}
    for s in x.addressable_shards:
        start, stop, _ = s.index[0].indices(x.shape[0])
        out[(start, stop)] = np.asarray(s.data)
    return True, [(a, b, rows) for (a, b), rows in sorted(out.items())]


def run(backend: str, layout_name: str, local_devices: int | None, env) -> None:
    layout = toolkit.parse_layout(layout_name)
    adapter = adapters.get(backend, dtype="float32", local_devices=local_devices)
    x, y = data()
    ids = {tuple(row.tolist()): i for i, row in enumerate(x)}
    seen: list = []
    real_step = adapter.train_step

    def recording_step(xb, yb, lr):
        seen.append(pieces_of(xb))
        return real_step(xb, yb, lr)

    adapter.train_step = recording_step
    model = GPT(vocab=32, context=8, width=16, layers=2, heads=4)
    trainer = toolkit.Trainer(adapter, model, toolkit.SGD(lr=0.1), global_batch_size=BATCH,
                              max_steps=STEPS, progress=False, layout=layout, env=env,
                              prefetch=True)
    trainer.fit(x, y)
    devices = adapter.local_device_count() if isinstance(adapter, DrivesDevices) else 1
    share = layout.data_share(env.world_size, env.rank, devices)
    sampler = trainer.sampler
    for step, (is_global, pieces) in enumerate(seen):
        batch = sampler.global_batch(0, step)
        decoded = [(a, b, [ids[tuple(r.tolist())] for r in rows]) for a, b, rows in pieces]
        emit({"layout": layout_name, "step": step, "share": [share.count, share.index],
              "global": batch.tolist(),
              "expected": batch[share.index::share.count].tolist(),
              "consumed": [i for _, _, rows in decoded for i in rows],
              "global_array": is_global, "pieces": decoded})


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("backend")
    p.add_argument("layouts")
    p.add_argument("--local-devices", type=int, default=None)
    args = p.parse_args()
    env = toolkit.current_env()
    for name in args.layouts.split(","):
        run(args.backend, name, args.local_devices, env)


if __name__ == "__main__":
    toolkit.run(main)
