"""Trains a native model with BatchNorm on the digits, reports one result per rank (``_emit.emit``).

    python tests/scripts/batchnorm_worker.py BACKEND SYNC(0|1) STEPS

The model is built identically on every rank (fixed seeds), with no dropout, so a run on N
ranks with synchronised BatchNorm must equal one process with the global batch.
"""

import sys

import numpy as np
from _emit import emit

import adapters
import toolkit
from toolkit.datasets import load_digits


def native_model(backend: str, sync: bool):
    if backend == "horovod-torch":
        import torch

        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.BatchNorm1d(32),
                                   torch.nn.ReLU(), torch.nn.Linear(32, 10))
    import flax.linen as nn
    import jax

    axis = "batch" if backend == "jax-pmap" and sync else None

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            x = nn.Dense(32)(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9, axis_name=axis)(x)
            return nn.Dense(10)(nn.relu(x))

    net = Net()
    return net, net.init(jax.random.PRNGKey(0), np.zeros((1, 64), np.float32))


def main() -> None:
    """``BACKEND SYNC STEPS``: SYNC is 1, 0, or both in turn in the same processes ("1,0")."""
    backend, steps = sys.argv[1], int(sys.argv[3])
    env = toolkit.current_env()
    for sync in (bool(int(v)) for v in sys.argv[2].split(",")):
        adapter = adapters.get(backend)
        adapter.setup(env)  # JAX must be configured before the Flax model is initialised
        (x, y), val = load_digits()
        trainer = toolkit.Trainer(adapter, native_model(backend, sync), toolkit.SGD(lr=0.1),
                                  global_batch_size=32, max_steps=steps, sync_batchnorm=sync,
                                  progress=False, env=env)
        history = trainer.fit(x, y)
        evaluation = trainer.evaluate(*val)
        state = adapter.state_dict()
        buffers = {k: float(np.sum(np.abs(v.astype(np.float64)))) for k, v in state.items()
                   if k.startswith("buffers/")}
        emit({"rank": env.rank, "sync": sync, "losses": history.losses, "buffers": buffers,
              "val": evaluation})


if __name__ == "__main__":
    toolkit.run(main)
