"""Run under a launcher with 2 ranks; each reports one result (``_emit.emit``: conformance).

Parameters are reported tensor by tensor (name -> nested lists of float64, which JSON carries
exactly), so that the test compares every element: a sum over all of them would not see an
output layer whose gradient is not averaged (with cross-entropy its gradient sums to zero
over the classes) nor weights that moved between positions."""

import sys

import numpy as np
from _emit import emit

import adapters
import toolkit

SPEC = toolkit.MLP((8, 16, 4))


def params_of(state):
    return {k[len("params/"):]: np.asarray(v).tolist() for k, v in sorted(state.items())
            if k.startswith("params/")}


def main() -> None:
    backend = sys.argv[1]
    env = toolkit.current_env()
    adapter = adapters.get(backend, dtype="float64")
    adapter.setup(env)
    adapter.build(SPEC, toolkit.SGD(lr=0.1, momentum=0.9), "cross_entropy", seed=env.rank)
    result = {"rank": env.rank, "initial": params_of(adapter.state_dict())}
    rank = float(env.rank)
    result["mean"] = adapter.allreduce(np.array([rank, 10 * rank]), "mean").tolist()
    result["sum"] = adapter.allreduce(np.array([rank, 10 * rank]), "sum").tolist()
    result["broadcast_from_1"] = adapter.broadcast(np.array([rank]), root=1).tolist()
    adapter.barrier()
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 8)), rng.integers(0, 4, size=8)
    result["local_loss"] = float(adapter.train_step(x[env.rank::2], y[env.rank::2], 0.1))
    result["after_step"] = params_of(adapter.state_dict())
    # The same step in one process on the whole batch, in float64 numpy (the first step of
    # SGD with momentum moves by lr * gradient).
    params = SPEC.init(0, "float64")
    _, grads = SPEC.loss_and_grads(params, x, y)
    result["single_process"] = {k: (params[k] - 0.1 * grads[k]).tolist() for k in sorted(params)}
    emit(result)


if __name__ == "__main__":
    toolkit.run(main)
