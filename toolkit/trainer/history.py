"""What a run reports: the History that ``Trainer.fit`` returns and rank 0's progress bar."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any


@dataclasses.dataclass
class History:
    """What :meth:`Trainer.fit` returns, the same on every rank.

    Attributes:
        losses: the training loss of each step this run made, averaged across ranks.
        epochs: one dict per finished epoch: ``epoch``, ``step``, ``loss`` (mean over the
            epoch's steps), ``val_loss``/``val_accuracy`` when validation data was given,
            ``seconds``.
        first_step: the global step the run started from (non-zero after a resume).
        world_size: how many ranks ran it.
        grad_norms: with ``clip_grad_norm`` (or ``on_nonfinite="skip"``), each step's
            gradient norm before clipping.
        skipped_steps: under ``on_nonfinite="skip"``, the steps that updated nothing because
            their gradient norm was not finite.
        loss_scales: under fp16 loss scaling, the scale of each step's loss.
        overflow_steps: under fp16 loss scaling, the steps the scaler skipped (a scaled
            gradient that was not finite; the scale was halved), apart from ``skipped_steps``.
        evaluations: each evaluation of ``fit``'s validation data, in order: ``step`` and
            ``val_loss`` (``val_accuracy``, ``val_<metric>``); the last is the returned
            model's (``fit`` evaluates its last step).
    """

    losses: list[float] = dataclasses.field(default_factory=list)
    epochs: list[dict[str, float]] = dataclasses.field(default_factory=list)
    first_step: int = 0
    world_size: int = 1
    grad_norms: list[float] = dataclasses.field(default_factory=list)
    skipped_steps: list[int] = dataclasses.field(default_factory=list)
    loss_scales: list[float] = dataclasses.field(default_factory=list)
    overflow_steps: list[int] = dataclasses.field(default_factory=list)
    evaluations: list[dict[str, float]] = dataclasses.field(default_factory=list)

    @property
    def final_loss(self) -> float:
        return self.losses[-1] if self.losses else math.nan


class MetricsLog:
    """The JSON-lines file rank 0 appends the run's records to (``None``: no file), each with
    the time it was written."""

    def __init__(self, path: str | os.PathLike | None, rank: int):
        self.path = Path(path) if path and rank == 0 else None

    def write(self, records: Iterable[dict]) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            for record in records:
                f.write(json.dumps({"time": round(time.time(), 3), **record}) + "\n")


class ProgressLine:
    """A progress bar on rank 0 (``tqdm``), only when stderr is a terminal: the steps, the
    loss, samples/s and the time left. Elsewhere (a Slurm log, CI) it writes nothing, so a log
    file never holds control characters; the interval lines say the same there.

    Args:
        enabled: show it (on a terminal).
        max_steps: the run's target (the Trainer's ``max_steps``): the bar counts the run's
            global steps towards it (``step 101/200``); None counts the epoch's steps
            (``epoch 0  101/1170 steps``).
        global_batch: samples per step (the bar's rate is in samples/s).
    """

    def __init__(self, enabled: bool, max_steps: int | None = None, global_batch: int = 1):
        self.enabled = enabled and sys.stderr.isatty()
        self.max_steps, self.global_batch = max_steps, global_batch
        self._last = 0.0
        self._bar: Any = None

    def update(self, step: int, epoch: int, epoch_step: int, epoch_steps: int,
               loss: Any) -> None:
        """After global step ``step``, the ``epoch_step``-th of ``epoch_steps`` in ``epoch``."""
        if not self.enabled:  # the loss may be a framework scalar: float() only when shown
            return
        now = time.monotonic()
        count, total = (step, self.max_steps) if self.max_steps is not None else (
            epoch_step, epoch_steps)
        if now - self._last > 0.2 or count == total:
            self._last = now
            text = f"{self.text(step, epoch, epoch_step, epoch_steps)}  loss {float(loss):.4f}"
            if self._bar is None:
                from tqdm import tqdm

                # (a terminal that reports no size, as a fresh pty does, is taken as 80 x 24:
                # tqdm would draw nothing in it)
                size = shutil.get_terminal_size()
                self._bar = tqdm(
                    total=total, initial=count, desc=text, file=sys.stderr, leave=False,
                    ncols=size.columns, nrows=size.lines,
                    mininterval=0, miniters=1, unit=" samples", unit_scale=self.global_batch,
                    bar_format="  {desc}  {bar:20}  {rate_fmt}  ETA {remaining}")
            else:
                self._bar.set_description_str(text, refresh=False)
                self._bar.update(count - self._bar.n)

    def text(self, step: int, epoch: int, epoch_step: int, epoch_steps: int) -> str:
        """What the bar counts: the run's steps when it has ``max_steps``, else the epoch's.

        Example:
            >>> ProgressLine(False, max_steps=200).text(101, 0, 101, 116988)
            'step 101/200'
            >>> ProgressLine(False).text(101, 0, 101, 116988)
            'epoch 0  101/116988 steps'
        """
        if self.max_steps is not None:
            return f"step {step}/{self.max_steps}"
        return f"epoch {epoch}  {epoch_step}/{epoch_steps} steps"

    def clear(self) -> None:
        """Removes the bar (at an epoch's end and the run's)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def eval_line(step: int, loss: float, record: dict) -> str:
    """Rank 0's line at an evaluation between epochs' ends (``eval_every``, the last step).

    Example:
        >>> eval_line(30, 0.61234, {"val_loss": 0.5, "val_accuracy": 0.875})
        'step 30  loss 0.6123  val_loss 0.5000  val_accuracy 0.8750'
    """
    trained = f"  loss {loss:.4f}" if math.isfinite(loss) else ""  # (nan: no step in this fit)
    return f"step {step}{trained}" + "".join(
        f"  {k} {v:.4f}" for k, v in record.items() if k.startswith("val_"))


def epoch_line(record: dict, seconds: float) -> str:
    """Rank 0's line at the end of an epoch, numbered from 0 as the metrics log, the
    checkpoint and the sampler number it."""
    line = f"epoch {record['epoch']}  step {record['step']}  loss {record['loss']:.4f}"
    if "val_loss" in record:
        line += f"  val_loss {record['val_loss']:.4f}"
        if "val_accuracy" in record:
            line += f"  val_accuracy {record['val_accuracy']:.4f}"
    return line + f"  ({seconds:.2f} s)"
