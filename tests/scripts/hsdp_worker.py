"""Started by tests/adapters/test_composed.py: HSDP, ``sharded:3+replicate:2`` on 4 devices
(ZeRO-3 over each replica's 2 devices, 2 replicas), in float64 with Adam and clipping:
``worker.py BACKEND FOLDER`` (JAX: 2 processes x 2 CPU devices, a process a replica;
the Horovod backends: 4 ranks, two consecutive ranks a replica).

1. Its losses and parameters equal the one-process float64 reference's (1e-10).
2. The bytes each process holds are ``toolkit.memory.estimate``'s for 2 shards (the replicas
   hold copies), times its devices.
3. Its checkpoint (each process's pieces; the second replica's empty) reads back as the state
   it returned, and a data-parallel run resumed from it goes on as the reference does.
Prints one ``ok <check>`` line per check; any mismatch raises.
"""

import sys
from pathlib import Path

import numpy as np

import adapters
import toolkit
from toolkit import memory
from toolkit.models.reference import reference_run

LAYOUT = "sharded:3+replicate:2"
MODEL = toolkit.MLP((5, 6, 4))  # units of 36 and 28 elements: no padding over 2 shards
OPTIMIZER, CLIP = toolkit.Adam(lr=1e-2), 0.5


def data():
    rng = np.random.default_rng(0)
    return rng.standard_normal((96, 5)), rng.integers(0, 4, 96)


def run(layout, steps, folder, resume=False):
    options = {"local_devices": 2} if BACKEND.startswith("jax-") else {}
    adapter = adapters.get(BACKEND, dtype="float64", **options)
    trainer = toolkit.Trainer(adapter, MODEL, OPTIMIZER, global_batch_size=16,
                              max_steps=steps, progress=False, layout=layout,
                              clip_grad_norm=CLIP, checkpoint_dir=folder, checkpoint_every=steps,
                              resume="auto" if resume else None)
    history = trainer.fit(*data())
    return adapter, history


def main(folder: str) -> None:
    # the one-process float64 reference: 3 steps (the state HSDP saves) and 5
    reference = {n: reference_run(MODEL, OPTIMIZER, "cross_entropy", *data(), steps=n,
                                  global_batch_size=16, clip_grad_norm=CLIP)
                 for n in (3, 5)}
    hsdp, hsdp_history = run(LAYOUT, 3, Path(folder))
    env, devices = hsdp.env, hsdp.local_device_count()
    if BACKEND == "jax-pjit":
        assert hsdp.strategy.mesh.shape == {"replicate": 2, "data": 2, "model": 1}, \
            hsdp.strategy.mesh.shape
    held, state = hsdp.memory_bytes(), hsdp.state_dict()
    losses, params = reference[3]
    np.testing.assert_allclose(hsdp_history.losses, losses, rtol=1e-10)
    for name, value in params.items():
        np.testing.assert_allclose(state[f"params/{name}"], value, atol=1e-10, err_msg=name)
    print(f"ok {LAYOUT} equals the reference on rank {env.rank}", flush=True)

    count = sum(a.size for a in MODEL.init(0).values())
    est = memory.estimate(count, toolkit.parse_layout(LAYOUT), 4, "float32", "adam")
    per_device = {"params": est.params, "grads": est.grads, "optimizer": est.optimizer}
    assert held == {k: devices * v * 2 for k, v in per_device.items()}, (held, est)  # float64
    print(f"ok bytes equal the estimate on rank {env.rank}: {held}", flush=True)

    # its checkpoint (pieces from the first replica's ranks) holds the state it returned, and
    # data parallelism resumes from it as the reference goes on
    saved = toolkit.read_checkpoint(sorted(Path(folder).glob("step_*"))[-1])
    assert saved.meta["shard_ranks"] == env.world_size
    for name, value in state.items():
        np.testing.assert_array_equal(saved.tensors[name], value, err_msg=name)
    _, resumed = run("data", 5, Path(folder), resume=True)
    np.testing.assert_allclose(resumed.losses[-2:], reference[5][0][3:], rtol=1e-10)
    print(f"ok the checkpoint resumes as data parallel on rank {env.rank}", flush=True)


if __name__ == "__main__":
    BACKEND = sys.argv[1]
    main(sys.argv[2])
