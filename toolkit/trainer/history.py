"""What a run reports: the History that ``Trainer.fit`` returns and rank 0's progress line."""

from __future__ import annotations

import dataclasses
import json
import math
import os
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
    """

    losses: list[float] = dataclasses.field(default_factory=list)
    epochs: list[dict[str, float]] = dataclasses.field(default_factory=list)
    first_step: int = 0
    world_size: int = 1
    grad_norms: list[float] = dataclasses.field(default_factory=list)
    skipped_steps: list[int] = dataclasses.field(default_factory=list)

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
    """A one-line progress display on rank 0, only when stderr is a terminal."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and sys.stderr.isatty()
        self._last = 0.0

    def update(self, epoch: int, done: int, total: int, loss: Any) -> None:
        if not self.enabled:  # the loss may be a framework scalar: float() only when shown
            return
        now = time.monotonic()
        if now - self._last > 0.2 or done == total:
            self._last = now
            sys.stderr.write(f"\r  epoch {epoch}  {done}/{total} steps  loss {float(loss):.4f} ")
            sys.stderr.flush()

    def clear(self) -> None:
        if self.enabled:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


def epoch_line(record: dict, seconds: float) -> str:
    """Rank 0's line at the end of an epoch."""
    line = f"epoch {record['epoch'] + 1}  step {record['step']}  loss {record['loss']:.4f}"
    if "val_loss" in record:
        line += f"  val_loss {record['val_loss']:.4f}"
        if "val_accuracy" in record:
            line += f"  val_accuracy {record['val_accuracy']:.4f}"
    return line + f"  ({seconds:.2f} s)"
