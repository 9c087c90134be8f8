"""TensorBoard event files of a run, written by rank 0 (``Trainer(tensorboard_dir=...)``,
``--tensorboard DIR``): the scalars of the metrics log, flushed at every interval.

The file is written with TensorBoard's own protocol buffers and record writer (the
``tensorboard`` package, imported when the first file opens), not with its
``EventFileWriter``, which opens files through ``tf.io.gfile`` and so imports TensorFlow
into every backend's process when it is installed.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import time
from pathlib import Path

from toolkit.errors import ToolkitError

# What each kind of metrics-log record gives TensorBoard (one value per tag and step): each
# step's loss, each interval's learning rate, throughput, times, norm, scale and MFU, and each
# evaluation's val_* values (not the count of what it evaluated, ``val_windows``), a final
# evaluation's under ``final/`` (it may share its step with a periodic one).
SCALARS = {"step": ("loss",),
           "interval": ("lr", "samples_per_s", "tokens_per_s", "step_time_s", "input_wait_s",
                        "grad_norm", "loss_scale", "mfu")}
COUNTS = frozenset({"val_windows"})


def check_tensorboard_dir(directory: str | os.PathLike | None) -> Path | None:
    """``directory`` as a Path; a ToolkitError when it names a file."""
    if directory is None:
        return None
    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise ToolkitError(f"tensorboard_dir {str(path)!r} is a file, not a directory",
                           "pass a directory (created if missing), e.g. --tensorboard runs/tb, "
                           "then: tensorboard --logdir runs/tb")
    return path


class TensorBoardLog:
    """An event file in ``directory`` on rank 0 (nothing elsewhere, or without a directory).

    Example:
        >>> tb = TensorBoardLog(None, rank=0)
        >>> tb.write({"event": "step", "step": 1, "loss": 2.0})   # no directory: nothing
    """

    def __init__(self, directory: str | os.PathLike | None, rank: int):
        self.directory = check_tensorboard_dir(directory) if rank == 0 else None
        self._file = self._writer = None
        if self.directory is not None and importlib.util.find_spec("tensorboard") is None:
            self._missing(ImportError("No module named 'tensorboard'"))

    def _missing(self, err: ImportError):
        raise ToolkitError(f"--tensorboard {self.directory} needs the tensorboard package "
                           f"({err})", ".venv/bin/pip install tensorboard (tools/install.sh "
                           "installs it)") from err

    def _open(self) -> None:
        try:
            from tensorboard.compat.proto import event_pb2, summary_pb2
            from tensorboard.summary.writer.record_writer import RecordWriter
        except ImportError as err:
            self._missing(err)
        self._event, self._summary = event_pb2.Event, summary_pb2.Summary
        self.directory.mkdir(parents=True, exist_ok=True)
        # TensorBoard's own naming: it reads every file matching *tfevents* in the directory.
        name = f"events.out.tfevents.{time.time():.0f}.{socket.gethostname()}.{os.getpid()}.0"
        self.path = self.directory / name
        self._file = open(self.path, "ab")
        self._writer = RecordWriter(self._file)
        self._record(self._event(wall_time=time.time(), file_version="brain.Event:2"))

    def _record(self, event) -> None:
        self._writer.write(event.SerializeToString())

    def write(self, record: dict) -> None:
        """The scalars of one metrics-log record (``step``, ``interval`` or ``eval``) at its
        step; None values (an unknown MFU) are left out."""
        if self.directory is None:
            return
        if self._file is None:
            self._open()
        kind = record.get("event")
        prefix = "final/" if kind == "eval" and record.get("final") else ""
        values = [self._summary.Value(tag=prefix + k, simple_value=float(v))
                  for k, v in record.items()
                  if (k in SCALARS.get(kind, ()) or kind == "eval" and k.startswith("val_")
                      and k not in COUNTS)
                  and isinstance(v, int | float) and not isinstance(v, bool)]
        if values:
            self._record(self._event(wall_time=record.get("time", time.time()),
                                     step=int(record["step"]),
                                     summary=self._summary(value=values)))

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = self._writer = None
