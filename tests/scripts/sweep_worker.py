"""A learning-rate sweep as a user writes one: each rate gets its own Trainer in the same
processes, and a rate that diverges is caught and the sweep goes on; reports one result per
rank (_emit).

    mpirun -np 2 python tests/scripts/sweep_worker.py BACKEND

The first rate (1e4) throws the digits MLP's loss past 3 x its best within a few steps: the
Trainer raises ``toolkit.TrainingDiverged`` on every rank; the second (0.05) then trains 5
steps.
"""

import sys

import numpy as np
from _emit import emit

import adapters
import toolkit
from toolkit.datasets import load_digits


def sweep(backend: str) -> None:
    (x, y), _ = load_digits()
    result = {"rank": toolkit.current_env().rank, "runs": []}
    for lr in (1e4, 0.05):
        trainer = toolkit.Trainer(adapters.get(backend), toolkit.MLP((64, 32, 10)),
                                  toolkit.SGD(lr=lr), global_batch_size=64, max_steps=5,
                                  progress=False, stop_check_every=1,
                                  divergence_factor=3.0, divergence_window=1)
        try:
            losses = trainer.fit(x, y).losses
            result["runs"].append({"lr": lr, "losses": [float(v) for v in losses]})
        except toolkit.TrainingDiverged as err:
            result["runs"].append({"lr": lr, "diverged": err.step})
    result["finite"] = bool(np.all(np.isfinite(result["runs"][-1].get("losses", [np.nan]))))
    emit(result)


if __name__ == "__main__":
    toolkit.run(lambda: sweep(sys.argv[1]))
