"""Your own PyTorch model, optimizer and loss: a small CNN with BatchNorm on the digits.

    python examples/bring_your_own/torch_cnn.py                        # one process
    horovodrun -np 2 python examples/bring_your_own/torch_cnn.py       # or: mpirun -np 2 ...
    srun -n 2 --mpi=pmix python examples/bring_your_own/torch_cnn.py   # inside a Slurm job

With --checkpoint-dir DIR, kill it at any moment and rerun with --resume latest to continue.
"""


import torch
from torch import nn

import adapters
import toolkit
from toolkit.datasets import load_digits


def smoothed_cross_entropy(logits, labels):
    """The loss contract: one loss per sample, shape (batch,); the Trainer averages them."""
    return nn.functional.cross_entropy(logits, labels, reduction="none", label_smoothing=0.05)


def accuracy(logits, labels):  # an evaluation metric: one value per sample, like the loss
    return (logits.argmax(dim=1) == labels).float()


def main() -> None:
    parser = toolkit.ArgumentParser(description=__doc__.splitlines()[0])
    toolkit.add_trainer_options(parser)  # epochs, batch, --layout, checkpoints, resume, ...
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--sync-batchnorm", action="store_true",
                        help="BatchNorm statistics over the global batch, not each rank's")
    args = parser.parse_args()

    (x, y), (val_x, val_y) = load_digits(seed=args.seed)
    x, val_x = x.reshape(-1, 1, 8, 8), val_x.reshape(-1, 1, 8, 8)  # NCHW
    torch.manual_seed(args.seed)  # rank 0's initial weights are broadcast to every rank anyway
    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Dropout(0.2), nn.Linear(32 * 4 * 4, 10))
    trainer = toolkit.Trainer(
        adapters.get("horovod-torch"), model,
        torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4),
        loss=smoothed_cross_entropy, metrics={"acc": accuracy},
        sync_batchnorm=args.sync_batchnorm, **toolkit.trainer_options(args))
    history = trainer.fit(x, y, (val_x, val_y))
    final = history.evaluations[-1]  # (fit evaluates the model it returns)
    toolkit.print0(f"done: world_size {trainer.env.world_size}  steps {trainer.global_step}  "
                   f"val_loss {final['val_loss']:.4f}  val_accuracy {final['val_acc']:.4f}")


if __name__ == "__main__":
    toolkit.run(main)
