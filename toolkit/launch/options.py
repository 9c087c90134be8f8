"""The Trainer's options on the command line: one table, so every script takes the same ones.

    parser = toolkit.ArgumentParser()
    toolkit.add_trainer_options(parser, epochs=10, batch_size=64)
    parser.add_argument("--lr", type=float, default=0.05)      # the script's own options
    args = parser.parse_args()
    trainer = toolkit.Trainer(backend, model, optimizer, **toolkit.trainer_options(args))
"""

from __future__ import annotations

import argparse
from typing import Any

from toolkit.precision import PRECISIONS

# option -> (the Trainer's keyword, argparse's settings). A default given to
# add_trainer_options replaces the one here.
OPTIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "--epochs": ("epochs", dict(type=int, default=10)),
    "--steps": ("max_steps", dict(type=int, default=None, help="stop after this many steps")),
    "--batch-size": ("global_batch_size",
                     dict(type=int, default=64, help="global batch (all ranks together)")),
    "--seed": ("seed", dict(type=int, default=0)),
    "--layout": ("layout", dict(default="data", help="data, sharded:1|2|3 or "
                                "pipeline:S:M[:schedule][:within-node=stages|replicas] "
                                "(docs/layouts)")),
    "--accumulation-steps": ("accumulation_steps", dict(type=int, default=1)),
    "--checkpoint-dir": ("checkpoint_dir", dict(default=None)),
    "--checkpoint-every": ("checkpoint_every",
                           dict(type=int, default=None, help="steps (and at the end)")),
    "--keep": ("keep", dict(type=int, default=3, help="checkpoints kept")),
    "--resume": ("resume", dict(default=None, help="'latest' (an error if there is none), "
                                "'auto' (the newest if any, else a new run: for jobs that "
                                "requeue) or a checkpoint directory")),
    "--allow-changes": ("allow_changes", dict(action="store_true", help="resume even if the "
                                              "schedule, batch, seed or optimizer differ")),
    "--metrics-log": ("metrics_log", dict(default=None, help="JSON-lines file (rank 0; "
                                          "docs/metrics.md)")),
    "--tensorboard": ("tensorboard_dir", dict(default=None, metavar="DIR", help="write "
                                              "TensorBoard event files there (rank 0)")),
    "--log-every": ("log_every", dict(type=int, default=0, help="print an interval line "
                                      "(loss, lr, samples/s, step time, MFU) every N steps")),
    "--eval-every": ("eval_every", dict(type=int, default=None, help="also evaluate the "
                                        "validation data every N steps (and at the last)")),
    "--peak-flops": ("peak_flops", dict(type=float, default=None, help="peak FLOP/s of one "
                                        "device, for the MFU (default: known GPUs' data sheet)")),
    "--precision": ("precision", dict(
        choices=PRECISIONS, default=None,
        help="the arithmetic's precision (docs/precision.md); default: the backend's dtype")),
    "--init-scale": ("init_scale", dict(
        type=float, default=None, help="fp16-mixed: the loss scale's first value, a power of "
                                       "two (default 65536)")),
    "--growth-interval": ("growth_interval", dict(
        type=int, default=None, help="fp16-mixed: clean steps after which the loss scale "
                                     "doubles (default 2000)")),
    "--activation-checkpointing": ("activation_checkpointing", dict(
        action=argparse.BooleanOptionalAction, default=None, help="recompute each block's "
        "activations in the backward pass (less memory, more compute), or with --no- never; "
        "default: the layout's choice (docs/memory.md)")),
    "--device": ("device", dict(choices=("auto", "cpu", "gpu"), default="auto",
                                help="auto: the rank's GPU when the framework sees one, else "
                                     "the CPU")),
    "--clip-grad-norm": ("clip_grad_norm", dict(type=float, default=None, help="clip each "
                                                "step's gradient to this global norm")),
    "--divergence-factor": ("divergence_factor", dict(
        type=float, default=None, help="stop when the loss stays above this factor x its best "
                                       "(a non-finite loss always stops)")),
    "--divergence-window": ("divergence_window", dict(
        type=int, default=20, help="steps the loss must stay above --divergence-factor x its "
                                   "best")),
    "--on-nonfinite": ("on_nonfinite", dict(
        choices=("stop", "skip"), default="stop", help="a step whose gradient norm is not "
                                                       "finite: stop the run, or skip the step")),
    "--max-consecutive-skips": ("max_consecutive_skips", dict(
        type=int, default=5, help="with --on-nonfinite skip: more skipped steps in a row stop")),
    "--stall-timeout": ("stall_timeout", dict(
        type=float, default=600.0, help="seconds a rank may be silent, or one step, checkpoint "
        "or evaluation may last, before the job ends naming the ranks that did not arrive "
        "(0: never)")),
}


def _dest(option: str) -> str:
    return option[2:].replace("-", "_")


def add_trainer_options(parser: argparse.ArgumentParser, skip: tuple[str, ...] = (),
                        **defaults: Any) -> argparse.ArgumentParser:
    """Adds the Trainer's options (epochs, steps, batch size, layout, checkpoints and resume,
    clipping, the divergence guard, the device) to ``parser``; read them back with
    :func:`trainer_options`.

    Args:
        parser: the script's parser (a :class:`toolkit.ArgumentParser`).
        skip: options the script does not take, by their name without dashes ("epochs").
        **defaults: new defaults by that name (``batch_size=32``).

    Example:
        >>> import argparse
        >>> p = add_trainer_options(argparse.ArgumentParser(), skip=("epochs",), steps=100)
        >>> trainer_options(p.parse_args(["--layout", "sharded:3"]))["layout"]
        'sharded:3'
        >>> trainer_options(p.parse_args([]))["max_steps"], "epochs" in vars(p.parse_args([]))
        (100, False)
    """
    unknown = set(defaults) | set(skip)
    unknown -= {_dest(option) for option in OPTIONS}
    if unknown:
        raise ValueError(f"add_trainer_options: no option named {sorted(unknown)} "
                         f"(the options: {', '.join(_dest(o) for o in OPTIONS)})")
    for option, (_, settings) in OPTIONS.items():
        name = _dest(option)
        if name in skip:
            continue
        settings = dict(settings)
        if name in defaults:
            settings["default"] = defaults[name]
        parser.add_argument(option, **settings)
    return parser


def trainer_options(args: argparse.Namespace) -> dict[str, Any]:
    """The Trainer's keyword arguments from what :func:`add_trainer_options` added."""
    return {keyword: getattr(args, _dest(option)) for option, (keyword, _) in OPTIONS.items()
            if hasattr(args, _dest(option))}
