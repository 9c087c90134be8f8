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
    toolkit.add_trainer_options(parser)  # epochs, batch, --layout, checkpoints, resume, ...
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--sync-batchnorm", action="store_true",
                        help="BatchNorm statistics over the global batch, not each rank's")
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
        sync_batchnorm=args.sync_batchnorm, **toolkit.trainer_options(args))
    history = trainer.fit(x, y, (val_x, val_y))
    final = history.evaluations[-1]  # (fit evaluates the model it returns)
    toolkit.print0(f"done: world_size {trainer.env.world_size}  steps {trainer.global_step}  "
                   f"val_loss {final['val_loss']:.4f}  val_accuracy {final['val_acc']:.4f}")


if __name__ == "__main__":
    toolkit.run(main)
