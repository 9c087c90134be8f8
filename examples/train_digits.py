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
    toolkit.add_trainer_options(parser)  # epochs, steps, batch, layout, checkpoints, ...
    parser.add_argument("--backend", default="horovod-torch",
                        help=f"one of {', '.join(adapters.BACKENDS)}")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    parser.add_argument("--dtype", choices=("float32", "float64"), default=None,
                        help="the parameters' dtype (float64: as --precision 64)")
    parser.add_argument("--compression", choices=("none", "fp16"), default=None,
                        help="Horovod backends: the gradient allreduce in float16")
    parser.add_argument("--local-devices", type=int, default=None,
                        help="JAX backends: CPU devices per process")
    parser.add_argument("--lr-scaling", choices=("none", "linear", "sqrt"), default="none")
    parser.add_argument("--save-model", default=None, help="write final weights (.npz) here")
    args = parser.parse_args()

    backend = adapters.get(args.backend, dtype=args.dtype, precision=args.precision,
                           local_devices=args.local_devices, compression=args.compression)
    (x_train, y_train), validation = load_digits(seed=args.seed, dtype=backend.dtype_name)
    optimizer = (toolkit.SGD(lr=args.lr, momentum=0.9) if args.optimizer == "sgd"
                 else toolkit.Adam(lr=args.lr))
    trainer = toolkit.Trainer(
        backend, toolkit.MLP((64, 128, 10)), optimizer, lr_scaling=args.lr_scaling,
        **toolkit.trainer_options(args))
    history = trainer.fit(x_train, y_train, validation)

    state = trainer.adapter.state_dict()
    if args.save_model:
        toolkit.save0(args.save_model, lambda f: np.savez(f, **state))
    final = history.evaluations[-1]  # (fit evaluates the model it returns)
    toolkit.print0(f"done: world_size {history.world_size}  steps {trainer.global_step}  "
                   f"final_loss {history.final_loss:.6f}  "
                   f"val_accuracy {final['val_accuracy']:.4f}")


if __name__ == "__main__":
    toolkit.run(main)
