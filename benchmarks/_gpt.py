"""The GPT options the benchmarks share (``activation_checkpointing.py``,
``tf_zero3_recompute.py``, ``pipeline_recompute.py``, ...), and the multi-process runs of
``sharded_memory.py`` and ``pipeline_zero.py``: a worker that trains the GPT under a launcher
and gathers every rank's figures, started by :func:`launch_worker`."""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
from _paired import time_steps

import toolkit

GPT_OPTIONS = ("--layers", "--width", "--heads", "--context", "--batch")


def gpt_options(p: argparse.ArgumentParser, *, context: int, batch: int,
                width: int = 128) -> None:
    """``--layers --width --heads --context --batch`` (sequences per step or micro-batch)."""
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=width)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=context)
    p.add_argument("--batch", type=int, default=batch, help="sequences per step")


def gpt_spec(args: argparse.Namespace, tied: bool = True) -> toolkit.GPT:
    """The byte-level GPT of those options."""
    return toolkit.GPT(vocab=256, context=args.context, width=args.width, layers=args.layers,
                       heads=args.heads, tied=tied)


def train_gpt(adapter, spec: toolkit.GPT, layout, batch: int, steps: int) -> float:
    """Trains ``spec`` (AdamW) for ``steps`` steps of ``batch`` sequences of the standard
    library's bytes under ``layout``; returns the median step time in seconds (the first step
    left out where there are more)."""
    from toolkit.equivalence import stdlib_bytes

    n = batch * 4
    tokens = stdlib_bytes(n * spec.context + 1).astype(np.int64)
    x, y = tokens[:-1].reshape(n, spec.context), tokens[1:].reshape(n, spec.context)
    times = time_steps(adapter)
    toolkit.Trainer(adapter, spec, toolkit.Adam(lr=1e-3, weight_decay=0.1, decoupled=True),
                    global_batch_size=batch, max_steps=steps, layout=layout, progress=False,
                    stop_signals=()).fit(x, y)
    return statistics.median(times[1:] or times)


def save_every_rank(adapter, row: list[float], out: str) -> None:
    """Every rank's ``row`` gathered (a sum of one-hot rows), written by rank 0 to ``out`` as
    ``{"ranks": [[...], ...]}``."""
    env = adapter.env
    table = np.zeros((env.world_size, len(row)))
    table[env.rank] = row
    table = adapter.allreduce(table.reshape(-1), "sum").reshape(env.world_size, len(row))
    toolkit.save0(out, json.dumps({"ranks": table.tolist()}), env=env)


def launch_worker(launcher: list[str], script: str, args: argparse.Namespace,
                  extra: list[str], out: Path) -> dict:
    """``launcher`` (e.g. ``["mpirun", "-np", "4"]``, or none) on ``script --worker`` with
    ``args``' GPT options, ``--steps`` and ``extra``; the JSON it wrote to ``out``, or
    ``{"error": ...}`` with the end of its output."""
    options = [a for o in (*GPT_OPTIONS, "--steps")
               for a in (o, str(getattr(args, o[2:])))]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([*launcher, sys.executable, script, "--worker", "--out", str(out),
                           *options, *extra], env=env, capture_output=True, text=True,
                          timeout=1200, stdin=subprocess.DEVNULL)
    if proc.returncode or not out.exists():
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        return {"error": f"exit {proc.returncode}: {tail}"}
    return json.loads(out.read_text())
