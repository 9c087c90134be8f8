"""Tokens per second of the toolkit's Trainer beside a hand-written loop of the same framework,
on the same GPT, the same data and the same optimizer, measured alternately in one process.

    .venv/bin/python benchmarks/gpt_throughput.py --backend horovod-torch
    .venv/bin/horovodrun -np 2 --gloo .venv/bin/python benchmarks/gpt_throughput.py \\
        --backend jax-pjit
    python benchmarks/gpt_throughput.py --backend horovod-torch --device gpu --gpt2-small \\
        --batch-size 8 --precision bf16-mixed   # on a GPU: GPT-2 small, tokens/s and MFU

Each window runs ``--steps`` steps of the Trainer, then ``--steps`` steps of the hand-written
loop (below, one short function per backend: what a user would write without the toolkit);
the order alternates between windows. Rank 0 prints the median tokens/s of each and the
median of the per-window ratios (toolkit time / hand-written time: the toolkit's overhead;
1.00 means none). The machine is noisy, so only ratios taken side by side mean anything.

On a GPU (``--device gpu``, or ``auto`` where the framework sees one) both run on the rank's
GPU, and each line adds the model FLOPs utilisation: (6 x parameters + 12 x layers x width x
context) FLOPs per token (the PaLM paper's count, attention included) x tokens/s over the
GPU's peak for the matmul precision (``--matmul``: ``float32`` keeps full float32, ``tf32``
lets both sides use TensorFloat-32; ``--precision bf16-mixed``: the bfloat16 peak), and the peak
GPU memory each held. The hand-written torch loop uses what a GPU user writes:
torch's fused AdamW, ``scaled_dot_product_attention`` (the same module as the Trainer's), the
batch copied from pinned memory, ``torch.autocast`` under bf16-mixed, no ``torch.compile`` (the
Trainer does not compile either); the JAX loop casts the parameters to bfloat16 inside its one
jitted step.
"""

import argparse
import statistics

import numpy as np
from _paired import trainer_against_hand

import adapters
import toolkit
from adapters._common import float32_matmuls
from toolkit.equivalence import stdlib_bytes
from toolkit.launch.devices import count_gpus
from toolkit.models.flops import gpt_flops_per_token, peak_flops


def windows(count: int, context: int):
    tokens = stdlib_bytes(count * context + 1).astype(np.int64)
    return tokens[:-1].reshape(count, context), tokens[1:].reshape(count, context)


# ------------------------------------------------------------------ hand-written loops
def torch_loop(spec, params, lr, env, dev, bf16: bool):
    """``dev``: the Trainer's device (the same GPU, or the CPU)."""
    import horovod.torch as hvd
    import torch

    from adapters.horovod_torch.models.gpt import build_gpt

    hvd.init()
    gpu = dev.type == "cuda"
    net, layout = build_gpt(torch, spec)
    net.to(dev)
    with torch.no_grad():
        for name, p, _, _ in layout:
            p.copy_(torch.from_numpy(params[name]))
    adamw = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.1, fused=gpu or None)
    opt = hvd.DistributedOptimizer(adamw, named_parameters=net.named_parameters())
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)

    def tensor(a):
        t = torch.from_numpy(a)
        return t.pin_memory().to(dev, non_blocking=True) if gpu else t

    def step(x, y):
        opt.zero_grad()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
            out = net(tensor(x)).float()
        loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]),
                                                 tensor(y).reshape(-1))
        loss.backward()
        opt.step()
        return loss.item()

    return step, lambda: None


def tf_loop(spec, params, lr, env):
    import horovod.tensorflow as hvd
    import keras
    import tensorflow as tf

    from adapters.horovod_tf.models.gpt import gpt_forward

    hvd.init()
    variables = {n: tf.Variable(v) for n, v in params.items()}
    trainable = list(variables.values())
    opt = keras.optimizers.AdamW(learning_rate=lr, weight_decay=0.1)
    opt.build(trainable)
    for v in trainable:
        v.assign(hvd.broadcast(v, root_rank=0))

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            logits = gpt_forward(tf, spec, variables, x)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
        grads = [hvd.allreduce(g, op=hvd.Average) for g in tape.gradient(loss, trainable)]
        opt.apply_gradients(zip(grads, trainable, strict=True))
        return loss

    return (lambda x, y: float(step(x, y))), lambda: None


def jax_loop(spec, params, lr, env, pmap: bool, bf16: bool):
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from adapters._jax.models.gpt import FlaxGPT, to_tree

    module, tx = FlaxGPT(spec), optax.adamw(lr, weight_decay=0.1)
    tree = to_tree(params)

    def loss_fn(p, x, y):
        if bf16:
            p = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), p)
        logp = jax.nn.log_softmax(module.apply({"params": p}, x).astype(jnp.float32))
        return -jnp.mean(jnp.take_along_axis(logp, y[..., None], axis=-1))

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
                                             y.reshape(d, -1, y.shape[1]))
            return loss
    else:
        mesh = Mesh(np.asarray(jax.devices()), ("data",))
        repl, batch = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh,
                                                                          PartitionSpec("data"))
        put = lambda t: jax.tree_util.tree_map(  # noqa: E731
            lambda a: jax.make_array_from_process_local_data(repl, np.asarray(a)), t)
        state = [put(tree), put(tx.init(tree))]
        jstep = jax.jit(lambda p, s, x, y: update(p, s, x, y, lambda g: g),
                        in_shardings=(repl, repl, batch, batch), out_shardings=(repl, repl, repl),
                        donate_argnums=(0, 1))

        def step(x, y):
            g = lambda a: jax.make_array_from_process_local_data(batch, a)  # noqa: E731
            state[0], state[1], loss = jstep(state[0], state[1], g(x.astype(np.int32)),
                                             g(y.astype(np.int32)))
            return loss

    return step, lambda: jax.block_until_ready(state)


# ------------------------------------------------------------------ the comparison
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="horovod-torch", choices=adapters.BACKENDS)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16, help="global, in sequences")
    p.add_argument("--steps", type=int, default=10, help="steps per window")
    p.add_argument("--windows", type=int, default=9)
    p.add_argument("--vocab", type=int, default=256, help="256 bytes, or e.g. 50304")
    p.add_argument("--gpt2-small", action="store_true",
                   help="GPT-2 small's shape: 12 layers, width 768, 12 heads, context 1024")
    p.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto")
    p.add_argument("--matmul", choices=("float32", "tf32"), default="float32",
                   help="on a GPU: full float32 matrix products, or TensorFloat-32")
    p.add_argument("--precision", choices=("32", "bf16-mixed"), default="32",
                   help="the arithmetic of both sides (docs/precision.md)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the GPU's peak for MFU (default: looked up from its name)")
    args = p.parse_args()
    if args.gpt2_small:
        args.layers, args.width, args.heads, args.context = 12, 768, 12, 1024

    env = toolkit.current_env()
    spec = toolkit.GPT(vocab=args.vocab, context=args.context, width=args.width,
                       layers=args.layers, heads=args.heads)
    x, y = windows(max(2048, 4 * args.batch_size), args.context)
    x, y = x % args.vocab, y % args.vocab
    lr = 1e-3
    name = args.backend
    if args.device != "cpu" and count_gpus():
        float32_matmuls(name, tf32=args.matmul == "tf32")  # both sides
    bf16 = args.precision == "bf16-mixed"
    trainer = toolkit.Trainer(adapters.get(args.backend, precision=args.precision), spec,
                              toolkit.Adam(lr=lr, weight_decay=0.1, decoupled=True),
                              global_batch_size=args.batch_size, max_steps=args.steps,
                              progress=False, stop_signals=(), device=args.device)
    trainer.fit(x, y)  # set-up, compilation, warm-up
    device = trainer.adapter.device_names()[0]
    gpu = device.startswith("gpu")
    params = spec.init(0, "float32")
    hand, sync = (torch_loop(spec, params, lr, env, trainer.adapter.runtime.dev, bf16)
                  if name == "horovod-torch" else
                  tf_loop(spec, params, lr, env) if name == "horovod-tf" else
                  jax_loop(spec, params, lr, env, pmap=name == "jax-pmap", bf16=bf16))
    tokens = args.steps * args.batch_size * args.context
    ours, theirs, ratio = trainer_against_hand(trainer, hand, sync, x, y, env,
                                               steps=args.steps,
                                               windows=args.windows, seed=0)
    rates = [tokens / statistics.median(t) for t in (ours, theirs)]
    mfu = ""
    if gpu:  # every rank's GPU: the world's tokens over the world's peak
        precision = "bfloat16" if bf16 else args.matmul
        peak = args.peak_tflops * 1e12 if args.peak_tflops else peak_flops(gpu_name(name),
                                                                           precision)
        if peak is None:
            raise SystemExit(f"no peak FLOP/s known for the GPU {gpu_name(name)!r} in "
                             f"{precision}: pass --peak-tflops (the data sheet's dense figure)")
        peak *= env.world_size
        per_token = gpt_flops_per_token(spec)
        mfu = "  MFU " + " / ".join(f"{r * per_token / peak:.1%}" for r in rates) + (
            f" (peak {peak / env.world_size / 1e12:.0f} TFLOP/s {precision} per GPU)"
            f"  peak memory {peak_memory(name) / 2**30:.2f} GiB (both sides, rank 0's GPU)")
    toolkit.print0(f"{name:14s} world {env.world_size} on {device}  GPT {spec.num_params:,} "
                   f"params, batch {args.batch_size}x{args.context}:  toolkit "
                   f"{rates[0]:,.0f} tokens/s  hand-written {rates[1]:,.0f} tokens/s  "
                   f"ratio {ratio:.3f}  precision {args.precision}{mfu}")


def peak_memory(backend: str) -> float:
    """The most bytes the framework held on this rank's GPU so far."""
    if backend == "horovod-torch":
        import torch

        return float(torch.cuda.max_memory_allocated())
    if backend.startswith("jax-"):
        import jax

        return float((jax.local_devices()[0].memory_stats() or {}).get("peak_bytes_in_use", 0))
    return 0.0


def gpu_name(backend: str) -> str:
    if backend == "horovod-torch":
        import torch

        return torch.cuda.get_device_name()
    if backend.startswith("jax-"):
        import jax

        return jax.local_devices()[0].device_kind
    return ""


if __name__ == "__main__":
    toolkit.run(main)
