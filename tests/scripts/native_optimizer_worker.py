"""A native model with the framework's own optimizer and LR schedule, under any layout; rank 0
reports the losses (_emit).

    mpirun -np 2 python tests/scripts/native_optimizer_worker.py BACKEND STEPS LAYOUT [LAYOUT...]
    mpirun -np 2 python tests/scripts/native_optimizer_worker.py BACKEND STEPS LAYOUT \
        --checkpoint-dir DIR [--stop-after N] [--resume]

horovod-torch: a torch ``nn.Sequential`` MLP on the digits with ``torch.optim.AdamW`` (or
``--optimizer NAME``, another torch.optim class) and a ``OneCycleLR`` over ``STEPS`` steps;
horovod-tf: a Keras ``Sequential`` MLP with ``keras.optimizers.AdamW`` (or ``--optimizer``) and
a warmup-cosine ``CosineDecay``. ``--spec``: the toolkit's small tied GPT on bytes in their
place, with the same optimizer (torch: passed as a function of the parameters). Clipped at 1.0,
in float64 (``--precision 32``: float32). Each LAYOUT (``data``, ``sharded:1``,
``pipeline:2:2``, ...) trains a fresh copy from the same seed for ``STEPS`` steps. With
``--checkpoint-dir``, one layout writes a checkpoint every 5 steps (stopping after
``--stop-after`` steps), or ``--resume`` continues from the latest.
"""

import argparse

import numpy as np
from _emit import emit

import adapters
import toolkit
from toolkit.datasets import load_digits
from toolkit.equivalence import load_data, make_model


def torch_build(steps: int, optimizer: str, spec: bool):
    import torch

    if spec:  # the optimizer as a function of the parameters the backend makes
        def build(params):
            opt = getattr(torch.optim, optimizer)(params, lr=1e-3, weight_decay=0.01)
            return opt, torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.02, total_steps=steps)

        return make_model("gpt"), build
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
                              torch.nn.Tanh(), torch.nn.Linear(32, 10))
    opt = getattr(torch.optim, optimizer)(net.parameters(), lr=1e-3, weight_decay=0.01)
    return net, (opt, torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.02, total_steps=steps))


def keras_build(steps: int, optimizer: str, spec: bool):
    import keras

    keras.config.set_floatx(DTYPE[0])
    keras.utils.set_random_seed(0)
    net = make_model("gpt") if spec else keras.Sequential([
        keras.Input((64,)), keras.layers.Dense(32, activation="tanh"),
        keras.layers.Dense(32, activation="tanh"), keras.layers.Dense(10)])
    schedule = keras.optimizers.schedules.CosineDecay(1e-3, decay_steps=steps,
                                                      warmup_target=0.02, warmup_steps=5)
    return net, getattr(keras.optimizers, optimizer)(learning_rate=schedule, weight_decay=0.01)


DTYPE = ["float64"]  # (--precision 32: float32)
BUILDERS = {"horovod-torch": torch_build, "horovod-tf": keras_build}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("backend", choices=sorted(BUILDERS))
    parser.add_argument("steps", type=int)
    parser.add_argument("layouts", nargs="+")
    parser.add_argument("--checkpoint-dir")
    parser.add_argument("--stop-after", type=int)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--optimizer", default="AdamW", help="the framework's optimizer class")
    parser.add_argument("--precision", choices=("32", "64"), default="64")
    parser.add_argument("--spec", action="store_true",
                        help="the toolkit's small tied GPT in place of the native model")
    args = parser.parse_args()
    DTYPE[0] = {"32": "float32", "64": "float64"}[args.precision]
    x, y = load_data("gpt", DTYPE[0]) if args.spec else load_digits(dtype=DTYPE[0])[0]
    for layout in args.layouts:
        adapter = adapters.get(args.backend, precision=args.precision)
        model, optimizer = BUILDERS[args.backend](args.steps, args.optimizer, args.spec)
        saving = {}
        if args.checkpoint_dir:
            saving = {"checkpoint_dir": args.checkpoint_dir, "checkpoint_every": 5,
                      "resume": "latest" if args.resume else None}
        trainer = toolkit.Trainer(
            adapter, model, optimizer,
            layout=None if layout == "data" else layout, global_batch_size=32,
            max_steps=args.stop_after or args.steps, clip_grad_norm=1.0, progress=False,
            **saving)
        losses = trainer.fit(x, y).losses
        if trainer.env.rank == 0:
            emit({"layout": layout, "start": trainer.global_step - len(losses),
                  "losses": np.asarray(losses, np.float64).tolist()})


if __name__ == "__main__":
    toolkit.run(main)
