"""Your own Keras model, optimizer and loss: a small CNN with BatchNormalization on the digits.

    python examples/bring_your_own/keras_cnn.py                        # one process
    horovodrun -np 2 python examples/bring_your_own/keras_cnn.py       # or: mpirun -np 2 ...
    srun -n 2 --mpi=pmix python examples/bring_your_own/keras_cnn.py   # inside a Slurm job

With --checkpoint-dir DIR, kill it at any moment and rerun with --resume latest to continue.
"""


import adapters
import toolkit
from toolkit.datasets import load_digits


def main() -> None:
    parser = toolkit.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch (all ranks)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto",
                        help="auto: the rank's GPU when the framework sees one, else the CPU")
    parser.add_argument("--clip-grad-norm", type=float, default=None,
                        help="clip each step's gradient to this global norm")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sync-batchnorm", action="store_true",
                        help="BatchNorm statistics over the global batch, not each rank's")
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--checkpoint-every", type=int, default=None, help="steps (and at the end)")
    parser.add_argument("--resume", default=None, help="'latest' or a checkpoint directory")
    args = parser.parse_args()

    backend = adapters.get("horovod-tf")
    backend.setup(toolkit.current_env())  # before Keras starts TensorFlow: quiet, threads set
    import keras

    def smoothed_cross_entropy(logits, labels):
        """The loss contract: one loss per sample, shape (batch,); the Trainer averages them."""
        return keras.losses.categorical_crossentropy(
            keras.ops.one_hot(labels, 10), logits, from_logits=True, label_smoothing=0.05)

    def accuracy(logits, labels):  # an evaluation metric: one value per sample, like the loss
        hits = keras.ops.argmax(logits, axis=1) == keras.ops.cast(labels, "int32")
        return keras.ops.cast(hits, "float32")

    (x, y), (val_x, val_y) = load_digits(seed=args.seed)
    x, val_x = x.reshape(-1, 8, 8, 1), val_x.reshape(-1, 8, 8, 1)  # NHWC
    keras.utils.set_random_seed(args.seed)  # rank 0's initial weights are broadcast anyway
    model = keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(16, 3, padding="same"), keras.layers.BatchNormalization(momentum=0.9),
        keras.layers.ReLU(),
        keras.layers.Conv2D(32, 3, padding="same"), keras.layers.BatchNormalization(momentum=0.9),
        keras.layers.ReLU(), keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(), keras.layers.Dropout(0.2), keras.layers.Dense(10)])
    trainer = toolkit.Trainer(
        backend, model, keras.optimizers.AdamW(args.lr, weight_decay=1e-4),
        loss=smoothed_cross_entropy, metrics={"acc": accuracy},
        sync_batchnorm=args.sync_batchnorm, global_batch_size=args.batch_size,
        epochs=args.epochs, seed=args.seed, checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every, resume=args.resume,
        clip_grad_norm=args.clip_grad_norm, device=args.device)
    trainer.fit(x, y, (val_x, val_y))
    final = trainer.evaluate(val_x, val_y)
    toolkit.print0(f"done: world_size {trainer.env.world_size}  steps {trainer.global_step}  "
                   f"val_loss {final['val_loss']:.4f}  val_accuracy {final['val_acc']:.4f}")


if __name__ == "__main__":
    toolkit.run(main)
