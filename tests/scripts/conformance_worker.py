"""Run under a launcher with 2 ranks; each reports one result (``_emit.emit``: conformance)."""

import sys

import numpy as np
from _emit import emit

import adapters
import toolkit

SPEC = toolkit.MLP((8, 16, 4))


def checksum(state):
    return float(sum(np.sum(v) for k, v in sorted(state.items()) if k.startswith("params/")))


def main() -> None:
    backend = sys.argv[1]
    env = toolkit.current_env()
    adapter = adapters.get(backend, dtype="float64")
    adapter.setup(env)
    adapter.build(SPEC, toolkit.SGD(lr=0.1, momentum=0.9), "cross_entropy", seed=env.rank)
    result = {"rank": env.rank, "initial_checksum": checksum(adapter.state_dict()),
              "seed0_checksum": float(sum(np.sum(v) for _, v in sorted(SPEC.init(0, "float64")
                                                                         .items())))}
    rank = float(env.rank)
    result["mean"] = adapter.allreduce(np.array([rank, 10 * rank]), "mean").tolist()
    result["sum"] = adapter.allreduce(np.array([rank, 10 * rank]), "sum").tolist()
    result["broadcast_from_1"] = adapter.broadcast(np.array([rank]), root=1).tolist()
    adapter.barrier()
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 8)), rng.integers(0, 4, size=8)
    result["local_loss"] = float(adapter.train_step(x[env.rank::2], y[env.rank::2], 0.1))
    result["after_step_checksum"] = checksum(adapter.state_dict())
    # The same step in one process on the whole batch, in float64 numpy.
    params = SPEC.init(0, "float64")
    _, grads = SPEC.loss_and_grads(params, x, y)
    result["single_process_checksum"] = float(sum(np.sum(params[k] - 0.1 * grads[k])
                                                   for k in sorted(params)))
    emit(result)


if __name__ == "__main__":
    toolkit.run(main)
