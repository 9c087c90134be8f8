"""Trains a Keras CNN with BatchNormalization on the digits (horovod-tf), reports one result
per rank.

    python tests/scripts/keras_batchnorm_worker.py SYNC(0|1) STEPS

The model is built identically on every rank (fixed seed), with no dropout and a Keras
optimizer, so a run on N ranks with synchronised BatchNorm must equal one process with the
global batch.
"""

import sys

import numpy as np
from _emit import emit

import adapters
import toolkit
from toolkit.datasets import load_digits


def keras_cnn():
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((8, 8, 1)), keras.layers.Conv2D(6, 3, padding="same"),
        keras.layers.BatchNormalization(momentum=0.9), keras.layers.ReLU(),
        keras.layers.Flatten(), keras.layers.Dense(10)])


def main() -> None:
    """``SYNC STEPS``: SYNC is 1, 0, or both in turn in the same processes ("1,0")."""
    steps = int(sys.argv[2])
    env = toolkit.current_env()
    for sync in (bool(int(v)) for v in sys.argv[1].split(",")):
        adapter = adapters.get("horovod-tf")
        adapter.setup(env)
        import keras

        (x, y), (vx, vy) = load_digits()
        x, vx = x.reshape(-1, 8, 8, 1), vx.reshape(-1, 8, 8, 1)
        trainer = toolkit.Trainer(adapter, keras_cnn(), keras.optimizers.SGD(0.05, momentum=0.9),
                                  global_batch_size=32, max_steps=steps, sync_batchnorm=sync,
                                  progress=False, env=env)
        history = trainer.fit(x, y)
        evaluation = trainer.evaluate(vx, vy)
        state = adapter.state_dict()
        buffers = {k: float(np.sum(np.abs(v.astype(np.float64)))) for k, v in state.items()
                   if k.startswith("buffers/")}
        emit({"rank": env.rank, "sync": sync, "losses": history.losses, "buffers": buffers,
              "val": evaluation})


if __name__ == "__main__":
    toolkit.run(main)
