"""The Trainer's per-step overhead beside a hand-written loop of the same framework, on an MLP
256-1024-1024-10 with SGD + momentum, measured in paired windows in one process.

    .venv/bin/python benchmarks/step_overhead.py --backend horovod-torch
    .venv/bin/horovodrun -np 2 --gloo .venv/bin/python benchmarks/step_overhead.py \\
        --backend jax-pmap

Each window runs ``--steps`` steps of the Trainer, then ``--steps`` steps of the hand-written
loop below (one short function per backend: what a user would write without the toolkit,
with the same framework mechanism: Horovod's DistributedOptimizer, a tf.function with
hvd.allreduce, pmap with pmean, jit over a mesh); the order alternates between windows. Rank 0
prints the median step time of each and the median of the per-window ratios (toolkit /
hand-written; 1.00 means no overhead). The machine is noisy: only ratios taken side by side
mean anything. Inputs are random floats (the cost of a step does not depend on their values).
"""

import argparse
import statistics

import numpy as np
from _paired import trainer_against_hand

import adapters
import toolkit

SIZES = (256, 1024, 1024, 10)


# ------------------------------------------------------------------ hand-written loops
def torch_loop(params, lr):
    import horovod.torch as hvd
    import torch

    hvd.init()
    layers = [torch.nn.Linear(a, b) for a, b in zip(SIZES[:-1], SIZES[1:], strict=True)]
    net = torch.nn.Sequential(layers[0], torch.nn.ReLU(), layers[1], torch.nn.ReLU(), layers[2])
    with torch.no_grad():
        for i, layer in enumerate(layers):
            layer.weight.copy_(torch.from_numpy(params[f"layers.{i}.kernel"].T))
            layer.bias.copy_(torch.from_numpy(params[f"layers.{i}.bias"]))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9),
                                   named_parameters=net.named_parameters())
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)

    def step(x, y):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(torch.from_numpy(x)), torch.from_numpy(y))
        loss.backward()
        opt.step()
        return loss.item()

    return step, lambda: None


def tf_loop(params, lr):
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    hvd.init()
    variables = [tf.Variable(params[f"layers.{i}.{k}"]) for i in range(3)
                 for k in ("kernel", "bias")]
    opt = keras.optimizers.SGD(learning_rate=lr, momentum=0.9)
    opt.build(variables)
    for v in variables:
        v.assign(hvd.broadcast(v, root_rank=0))

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            h = x
            for i in range(3):
                h = tf.matmul(h, variables[2 * i]) + variables[2 * i + 1]
                h = tf.nn.relu(h) if i < 2 else h
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, h))
        grads = [hvd.allreduce(g, op=hvd.Average) for g in tape.gradient(loss, variables)]
        opt.apply_gradients(zip(grads, variables, strict=True))
        return loss

    return step, lambda: None


def jax_loop(params, lr, pmap: bool):
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    tx = optax.sgd(lr, momentum=0.9)
    tree = {k: jnp.asarray(v) for k, v in params.items()}

    def loss_fn(p, x, y):
        h = x
        for i in range(3):
            h = h @ p[f"layers.{i}.kernel"] + p[f"layers.{i}.bias"]
            h = jax.nn.relu(h) if i < 2 else h
        logp = jax.nn.log_softmax(h)
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=-1))

    def update(p, s, x, y, reduce):
        loss, grads = jax.value_and_grad(loss_fn)(p, x, y)
        updates, s = tx.update(reduce(grads), s, p)
        return optax.apply_updates(p, updates), s, loss

    if pmap:
        devices = jax.local_devices()
        stacked = NamedSharding(Mesh(np.asarray(devices), ("d",)), PartitionSpec("d"))
        put = lambda t: jax.tree_util.tree_map(  # noqa: E731
            lambda a: jax.device_put(np.stack([np.asarray(a)] * len(devices)), stacked), t)
        state = [put(tree), put(tx.init(tree))]
        pstep = jax.pmap(lambda p, s, x, y: update(p, s, x, y,
                                                   lambda g: jax.lax.pmean(g, "batch")),
                         axis_name="batch", donate_argnums=(0, 1))

        def step(x, y):
            d = len(devices)
            state[0], state[1], loss = pstep(state[0], state[1], x.reshape(d, -1, x.shape[1]),
                                             y.astype(np.int32).reshape(d, -1))
            return loss
    else:
        mesh = Mesh(np.asarray(jax.devices()), ("data",))
        repl = NamedSharding(mesh, PartitionSpec())
        batch = NamedSharding(mesh, PartitionSpec("data"))
        put = lambda t: jax.tree_util.tree_map(  # noqa: E731
            lambda a: jax.make_array_from_process_local_data(repl, np.asarray(a)), t)
        state = [put(tree), put(tx.init(tree))]
        jstep = jax.jit(lambda p, s, x, y: update(p, s, x, y, lambda g: g),
                        in_shardings=(repl, repl, batch, batch), out_shardings=(repl, repl, repl),
                        donate_argnums=(0, 1))

        def step(x, y):
            g = lambda a: jax.make_array_from_process_local_data(batch, a)  # noqa: E731
            state[0], state[1], loss = jstep(state[0], state[1], g(x), g(y.astype(np.int32)))
            return loss

    return step, lambda: jax.block_until_ready(state)


# ------------------------------------------------------------------ the comparison
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="horovod-torch", choices=adapters.BACKENDS)
    p.add_argument("--batch-size", type=int, default=256, help="global")
    p.add_argument("--steps", type=int, default=100, help="steps per window (each window is one "
                   "fit call, whose fixed cost, about 1 ms, this spreads thin)")
    p.add_argument("--windows", type=int, default=15)
    p.add_argument("--prefetch", choices=("auto", "on", "off"), default="auto",
                   help="the Trainer's prefetch (auto, its default: in-memory arrays load "
                        "inline)")
    args = p.parse_args()

    env = toolkit.current_env()
    rng = np.random.default_rng(0)
    # Enough samples that no epoch ends during the measurement (an epoch end evaluates and
    # prints, which is not per-step overhead).
    n = args.batch_size * args.steps * (args.windows + 2)
    x = rng.standard_normal((n, SIZES[0])).astype(np.float32)
    y = rng.integers(0, SIZES[-1], len(x))
    lr = 0.01
    spec = toolkit.MLP(SIZES)
    trainer = toolkit.Trainer(adapters.get(args.backend), spec,
                              toolkit.SGD(lr=lr, momentum=0.9),
                              global_batch_size=args.batch_size, max_steps=args.steps,
                              progress=False, stop_signals=(),
                              prefetch={"auto": "auto", "on": True, "off": False}[args.prefetch])
    trainer.fit(x, y)  # set-up, compilation, warm-up
    params = spec.init(0, "float32")
    name = args.backend
    hand, sync = (torch_loop(params, lr) if name == "horovod-torch" else
                  tf_loop(params, lr) if name == "horovod-tf" else
                  jax_loop(params, lr, pmap=name == "jax-pmap"))
    ours, theirs, ratio = trainer_against_hand(trainer, hand, sync, x, y, env,
                                               steps=args.steps,
                                               windows=args.windows, seed=1)
    ms = lambda t: statistics.median(t) / args.steps * 1e3  # noqa: E731
    toolkit.print0(f"{name:14s} world {env.world_size}  MLP {'-'.join(map(str, SIZES))}, "
                   f"batch {args.batch_size}:  toolkit {ms(ours):.2f} ms/step  hand-written "
                   f"{ms(theirs):.2f} ms/step  ratio {ratio:.3f} (median of {args.windows} "
                   "paired windows)")


if __name__ == "__main__":
    toolkit.run(main)
