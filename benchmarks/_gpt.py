"""The GPT options the activation benchmarks share (``activation_checkpointing.py``,
``tf_zero3_recompute.py``, ``pipeline_recompute.py``)."""

import argparse

import toolkit


def gpt_options(p: argparse.ArgumentParser, *, context: int, batch: int) -> None:
    """``--layers --width --heads --context --batch`` (sequences per step or micro-batch)."""
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=context)
    p.add_argument("--batch", type=int, default=batch, help="sequences per step")


def gpt_spec(args: argparse.Namespace) -> toolkit.GPT:
    """The byte-level GPT of those options."""
    return toolkit.GPT(vocab=256, context=args.context, width=args.width, layers=args.layers,
                       heads=args.heads)
