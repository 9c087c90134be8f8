"""Train an MLP on scikit-learn's bundled handwritten digits, on any backend and launcher.

    python examples/train_digits.py                               # one process
    horovodrun -np 2 python examples/train_digits.py              # or: mpirun -np 2 ...
    srun -n 2 --mpi=pmix python examples/train_digits.py          # inside a Slurm job

Kill it at any moment and rerun the same command with ``--resume latest`` to continue.
"""


import numpy as np

import adapters
import toolkit
from toolkit.datasets import load_digits


def main() -> None:
    parser = toolkit.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="horovod-torch",
                        help=f"one of {', '.join(adapters.BACKENDS)}")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--steps", type=int, default=None, help="stop after this many steps")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch (all ranks)")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--local-devices", type=int, default=None,
                        help="JAX backends: CPU devices per process")
    parser.add_argument("--lr-scaling", choices=("none", "linear", "sqrt"), default="none")
    parser.add_argument("--layout", default="data",
                        help="data (default), sharded:1|2|3 or pipeline:S:M[:schedule]")
    parser.add_argument("--accumulation-steps", type=int, default=1)
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--checkpoint-every", type=int, default=None, help="steps")
    parser.add_argument("--keep", type=int, default=3)
    parser.add_argument("--resume", default=None, help="'latest' or a checkpoint directory")
    parser.add_argument("--allow-changes", action="store_true",
                         help="resume even if the schedule, batch, seed or optimizer differ")
    parser.add_argument("--metrics-log", default=None, help="JSON-lines file (rank 0)")
    parser.add_argument("--save-model", default=None, help="write final weights (.npz) here")
    parser.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto",
                        help="auto: the rank's GPU when the framework sees one, else the CPU")
    parser.add_argument("--clip-grad-norm", type=float, default=None,
                        help="clip each step's gradient to this global norm")
    parser.add_argument("--divergence-factor", type=float, default=None,
                        help="stop when the loss stays above this factor x its best (a "
                             "non-finite loss always stops)")
    parser.add_argument("--divergence-window", type=int, default=20,
                        help="steps the loss must stay above --divergence-factor x its best")
    parser.add_argument("--on-nonfinite", choices=("stop", "skip"), default="stop",
                        help="a step whose gradient norm is not finite: stop the run, or skip "
                             "the step (no update)")
    parser.add_argument("--max-consecutive-skips", type=int, default=5,
                        help="with --on-nonfinite skip: more skipped steps in a row stop")
    args = parser.parse_args()

    (x_train, y_train), validation = load_digits(seed=args.seed, dtype=args.dtype)
    optimizer = (toolkit.SGD(lr=args.lr, momentum=0.9) if args.optimizer == "sgd"
                 else toolkit.Adam(lr=args.lr))
    trainer = toolkit.Trainer(
        adapters.get(args.backend, dtype=args.dtype, local_devices=args.local_devices),
        toolkit.MLP((64, 128, 10)),
        optimizer,
        global_batch_size=args.batch_size,
        epochs=args.epochs,
        max_steps=args.steps,
        seed=args.seed,
        lr_scaling=args.lr_scaling,
        accumulation_steps=args.accumulation_steps,
        layout=args.layout,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        keep=args.keep,
        resume=args.resume,
        allow_changes=args.allow_changes,
        metrics_log=args.metrics_log,
        clip_grad_norm=args.clip_grad_norm, device=args.device,
        divergence_factor=args.divergence_factor,
        divergence_window=args.divergence_window,
        on_nonfinite=args.on_nonfinite, max_consecutive_skips=args.max_consecutive_skips,
    )
    history = trainer.fit(x_train, y_train, validation)

    state = trainer.adapter.state_dict()
    if args.save_model:
        toolkit.save0(args.save_model, lambda f: np.savez(f, **state))
    final = trainer.evaluate(*validation)
    toolkit.print0(f"done: world_size {history.world_size}  steps {trainer.global_step}  "
                   f"final_loss {history.final_loss:.6f}  "
                   f"val_accuracy {final['val_accuracy']:.4f}")


if __name__ == "__main__":
    toolkit.run(main)
