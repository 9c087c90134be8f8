"""horovod-tf sharded layouts under a launcher (2-3 ranks); each rank reports a result (_emit).

Checks (see tests/adapters/test_sharded_tf.py): Horovod's reduce-scatter and all-gather inside
``tf.function`` against numpy with per-rank chunks of at least 1 MiB; the gradient shard each
stage keeps against a numpy gradient on a model whose unit is over 1 MiB per rank;
``memory_bytes`` and the checkpoint pieces of every stage; accumulation, a custom loss, a metric
and evaluation under every stage against data parallel (float64).
"""

import os
import sys
import time

import numpy as np
from _emit import emit

import adapters
import toolkit
from toolkit.parallel.shards import unit_layouts

CHUNK = 262144 + 3  # float32 elements per rank: just over 1 MiB


def collectives(tf, hvd, rank, size):
    """Largest deviations of reducescatter (Average, Sum) and allgather from numpy."""
    every = [np.random.default_rng(100 + r).standard_normal(size * CHUNK).astype(np.float32)
             for r in range(size)]
    mine = tf.constant(every[rank])
    average = tf.function(lambda t: hvd.reducescatter(t, op=hvd.Average))(mine).numpy()
    total = tf.function(lambda t: hvd.reducescatter(t, op=hvd.Sum))(mine).numpy()
    gathered = tf.function(lambda t: hvd.allgather(t))(mine[rank * CHUNK:(rank + 1) * CHUNK])
    want_sum = np.sum([e.astype(np.float64) for e in every], 0)[rank * CHUNK:(rank + 1) * CHUNK]
    want_gather = np.concatenate([e[r * CHUNK:(r + 1) * CHUNK] for r, e in enumerate(every)])
    return {"rs_shape": list(average.shape), "rs_average_dev": float(
        np.max(np.abs(average - want_sum / size))), "rs_sum_dev": float(
        np.max(np.abs(total - want_sum))), "allgather_equal": bool(
        np.array_equal(gathered.numpy(), want_gather))}


def gradient_shards(env, size):
    """Per stage: the largest deviation of the gradient this rank keeps from numpy's average
    gradient (its shard; in full for stage 1), on a 512x1536 layer (> 1 MiB per rank)."""
    spec = toolkit.MLP((512, 1536))
    rng = np.random.default_rng(7)
    x, y = rng.normal(size=(4 * size, 512)), rng.normal(size=(4 * size, 1536))
    params = spec.init(0, "float64")
    _, want = spec.loss_and_grads(params, x, y, "mse")  # the global batch's mean gradient
    (lay,) = unit_layouts({n: p.shape for n, p in params.items()}, size).values()
    out = {"unit_shard_bytes": lay.shard_size * 4}
    for stage in (1, 2, 3):
        adapter = adapters.get("horovod-tf")
        adapter.setup(env, toolkit.Sharded(stage))
        adapter.build(spec, toolkit.SGD(lr=0.0), "mse", seed=0)
        adapter.train_step(x[env.rank::size].astype(np.float32),
                           y[env.rank::size].astype(np.float32), 0.0)
        (held,) = adapter.strategy.shards.grads.values()
        flat = lay.flatten(want)
        expect = flat if stage == 1 else lay.shard(want, env.rank)
        got = held.numpy()
        out[f"grad_stage{stage}"] = {"shape": list(got.shape), "want_shape": list(expect.shape),
                                     "rel_dev": float(np.max(np.abs(got - expect))
                                                      / np.max(np.abs(flat)))}
    return out


def memory_and_pieces(env, size):
    """memory_bytes of every stage and its expected value from the variables' shapes; whether
    the pieces of every rank concatenate to the full tensors (checked by the test)."""
    spec = toolkit.MLP((8, 16, 4))  # units of 144 and 68 elements: padding at 3 ranks
    init = spec.init(0, "float32")
    lays = unit_layouts({n: p.shape for n, p in init.items()}, size)
    total = sum(lay.total for lay in lays.values())
    padded = sum(lay.padded for lay in lays.values())
    shard = sum(lay.shard_size for lay in lays.values())
    out = {}
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(2 * size, 8)), rng.integers(0, 4, size=2 * size)
    for stage in (1, 2, 3):
        adapter = adapters.get("horovod-tf")
        adapter.setup(env, toolkit.Sharded(stage))
        adapter.build(spec, toolkit.Adam(lr=1e-2), "cross_entropy", seed=env.rank)
        initial = adapter.state_dict()
        adapter.train_step(x[env.rank::size], y[env.rank::size], 1e-2)
        want = {"params": 4 * (shard if stage == 3 else total),
                "grads": 4 * (padded if stage == 1 else shard), "optimizer": 4 * 2 * shard}
        variables = ([*adapter.strategy.shards.params.values()] if stage == 3 else
                     [*adapter.strategy.shards.vars.values()])
        replicated, pieces = adapter.sharded_state()
        full = adapter.state_dict()
        out[f"stage{stage}"] = {
            "memory": adapter.memory_bytes(), "want": want,
            "param_variable_shapes": sorted({tuple(v.shape) for v in variables}),
            "initial_is_rank0_seed": all(np.array_equal(initial[f"params/{n}"], a)
                                         for n, a in init.items()),
            "replicated": sorted(replicated),
            "pieces": {n: [p.tolist(), axis, list(shape)]
                       for n, (p, axis, shape) in sorted(pieces.items())},
            "full": {n: v.reshape(-1).tolist() for n, v in sorted(full.items())
                     if n.startswith(("params/", "opt/mu/", "opt/nu/"))}}
    return out


def layouts_agree(env, size):
    """Losses, parameters and evaluation of every stage minus data parallel's (float64), with
    2 accumulation steps, a custom loss, a metric and validation."""
    import tensorflow as tf

    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(48, 8)), rng.integers(0, 4, size=48)

    def loss(out, labels):  # per-sample cross entropy plus a small square penalty
        ce = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=out)
        return ce + 0.01 * tf.reduce_sum(out * out, axis=1)

    def margin(out, labels):
        return tf.reduce_max(out, axis=1) - tf.reduce_min(out, axis=1)

    def run(model, layout, data):
        adapter = adapters.get("horovod-tf", dtype="float64")
        trainer = toolkit.Trainer(
            adapter, model, toolkit.SGD(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
            loss=loss if data is None else "cross_entropy", layout=layout, metrics=(
                {"margin": margin} if data is None else None), global_batch_size=12,
            max_steps=4, accumulation_steps=2, progress=False, env=env, eval_batch_size=5)
        xs, ys = (x, y) if data is None else data
        history = trainer.fit(xs, ys)
        return history.losses, adapter.state_dict(), trainer.evaluate(xs[:21], ys[:21])

    out = {}
    mlp = toolkit.MLP((8, 16, 4))
    tokens = rng.integers(0, 11, size=(48, 5))
    gpt = toolkit.GPT(vocab=11, context=6, width=8, layers=2, heads=2)
    for name, model, data, layouts in (("mlp", mlp, None, (1, 2, 3)),
                                       ("gpt", gpt, (tokens, tokens), (3,))):
        base = run(model, None, data)
        for stage in layouts:
            losses, state, evaluation = run(model, toolkit.Sharded(stage), data)
            out[f"{name}_stage{stage}"] = {
                "loss_dev": float(np.max(np.abs(np.subtract(losses, base[0])))),
                "param_dev": max(float(np.max(np.abs(state[k] - base[1][k]))) for k in base[1]),
                "eval_keys": sorted(evaluation),
                "eval_dev": max(abs(evaluation[k] - base[2][k]) for k in base[2])}
    return out


def main() -> None:
    import horovod.tensorflow as hvd
    import tensorflow as tf

    env = toolkit.current_env()
    hvd.init()
    size, rank = hvd.size(), hvd.rank()
    parts = sys.argv[1].split(",")  # which checks to run
    result = {"rank": rank, "size": size, "seconds": {},
              # Which transport Horovod's collectives run over: the launcher decides.
              "transport": {"gloo": hvd.gloo_enabled(), "mpi": hvd.mpi_enabled(),
                            "gloo_rendezvous": "HOROVOD_GLOO_RENDEZVOUS_ADDR" in os.environ}}
    for part, check in (("collectives", lambda: collectives(tf, hvd, rank, size)),
                        ("gradients", lambda: gradient_shards(env, size)),
                        ("state", lambda: memory_and_pieces(env, size)),
                        ("layouts", lambda: layouts_agree(env, size))):
        if part in parts:
            start = time.perf_counter()
            result[part] = check()
            result["seconds"][part] = round(time.perf_counter() - start, 1)
    emit(result)


if __name__ == "__main__":
    toolkit.run(main)
