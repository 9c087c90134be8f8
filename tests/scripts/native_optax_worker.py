"""One run of tests/adapters/test_native_optimizers_jax.py's setup (an MLP, optax.adamw with a
warmup-cosine schedule), as a test imports it or as each rank of a multi-process launch runs it:

    mpirun -np 2 python tests/scripts/native_optax_worker.py BACKEND LAYOUT STEPS CKPT [latest]

trains to STEPS with a checkpoint in CKPT at the end (resuming the latest one with ``latest``)
and emits rank 0's ``{"losses", "first_step"}`` (tests/scripts/_emit.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

import adapters
import toolkit

STEPS, BATCH = 20, 16
MODEL = toolkit.MLP((5, 6, 6, 3))  # three layers: two pipeline stages


def data(n=48, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 5)), rng.integers(0, 3, n)


def adamw():
    import optax

    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, warmup_steps=5, decay_steps=STEPS)
    return optax.adamw(schedule, weight_decay=1e-2)


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from _emit import emit

    backend, layout, steps, ckpt, *resume = sys.argv[1:]
    x, y = data()
    adapter = adapters.get(backend)
    trainer = toolkit.Trainer(adapter, MODEL, adamw(), global_batch_size=BATCH,
                              max_steps=int(steps), progress=False,
                              layout=toolkit.parse_layout(layout), checkpoint_dir=ckpt,
                              checkpoint_every=int(steps), resume=resume[0] if resume else None)
    history = trainer.fit(x, y)
    if adapter.env.rank == 0:
        emit({"losses": [float(v) for v in history.losses], "first_step": history.first_step})


if __name__ == "__main__":
    main()
