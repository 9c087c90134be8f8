"""Your own Flax model, optax optimizer and loss: a small CNN with BatchNorm on the digits.

    python examples/bring_your_own/flax_cnn.py                         # one process
    horovodrun -np 2 python examples/bring_your_own/flax_cnn.py        # or: mpirun -np 2 ...
    srun -n 2 --mpi=pmix python examples/bring_your_own/flax_cnn.py    # inside a Slurm job
    mpirun -np 2 python examples/bring_your_own/flax_cnn.py --layout pipeline:2:2  # or sharded:3

With --checkpoint-dir DIR, kill it at any moment and rerun with --resume latest to continue.
"""


import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import adapters
import toolkit
from toolkit.datasets import load_digits


class ConvBlock(nn.Module):
    """Conv, BatchNorm, ReLU: batch statistics (and their running averages updated) when
    ``train``, the running averages otherwise."""

    width: int
    batchnorm_axis: str | None = None  # "batch": jax-pmap normalises over every device

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Conv(self.width, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9,
                         axis_name=self.batchnorm_axis)(x)
        return nn.relu(x)


class Head(nn.Module):
    """Dropout (when ``train``), then a dense layer to the 10 classes."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        return nn.Dense(10)(nn.Dropout(0.2, deterministic=not train)(x))


def pool(x):
    return nn.max_pool(x, (2, 2), strides=(2, 2)).reshape((x.shape[0], -1))


class CNN(nn.Sequential):
    """Conv-BatchNorm-ReLU twice, pooling, dropout, a dense head: a Sequential of layers, so a
    pipeline can cut it into stages, each holding its layers' parameters and BatchNorm
    statistics. The backends pass ``train=True`` (batch statistics, dropout) in steps and
    ``train=False`` in evaluation; this hands it on to every layer (``nn.Sequential`` gives
    its arguments to the first layer only), as a pipeline stage does with the layers it runs."""

    def __call__(self, x, train: bool = False):
        for layer in self.layers:
            x = layer(x, train=train) if isinstance(layer, nn.Module) else layer(x)
        return x


def smoothed_cross_entropy(logits, labels):
    """The loss contract: one loss per sample, shape (batch,); the Trainer averages them."""
    targets = optax.smooth_labels(jax.nn.one_hot(labels, 10), 0.05)
    return optax.softmax_cross_entropy(logits, targets)


def accuracy(logits, labels):  # an evaluation metric: one value per sample, like the loss
    return (jnp.argmax(logits, axis=1) == labels).astype(jnp.float32)


def main() -> None:
    parser = toolkit.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("jax-pjit", "jax-pmap"), default="jax-pjit")
    toolkit.add_trainer_options(parser)  # epochs, batch, --layout, checkpoints, resume, ...
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--sync-batchnorm", action="store_true",
                        help="BatchNorm statistics over the global batch (jax-pjit always)")
    args = parser.parse_args()

    backend = adapters.get(args.backend)
    backend.setup(toolkit.current_env())  # configures JAX's devices before module.init uses it
    (x, y), (val_x, val_y) = load_digits(seed=args.seed)
    x, val_x = x.reshape(-1, 8, 8, 1), val_x.reshape(-1, 8, 8, 1)  # NHWC
    # Under jax-pmap a BatchNorm with an axis name normalises over every device's samples;
    # jax-pjit runs one program over the global batch, so its statistics are global anyway.
    sync_axis = "batch" if args.sync_batchnorm and args.backend == "jax-pmap" else None
    module = CNN([ConvBlock(16, sync_axis), ConvBlock(32, sync_axis), pool, Head()])
    variables = module.init(jax.random.key(args.seed), x[:1])  # params and batch_stats
    trainer = toolkit.Trainer(
        backend, (module, variables), optax.adamw(args.lr, weight_decay=1e-4),
        loss=smoothed_cross_entropy, metrics={"acc": accuracy},
        sync_batchnorm=args.sync_batchnorm, **toolkit.trainer_options(args))
    history = trainer.fit(x, y, (val_x, val_y))
    final = history.evaluations[-1]  # (fit evaluates the model it returns)
    toolkit.print0(f"done: world_size {trainer.env.world_size}  steps {trainer.global_step}  "
                   f"val_loss {final['val_loss']:.4f}  val_accuracy {final['val_acc']:.4f}")


if __name__ == "__main__":
    toolkit.run(main)
