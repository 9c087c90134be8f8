"""Stopping on a signal: what a preempted ``fit`` raises, and the handlers that note a signal."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: "try again later", what a requeued job should do


class TrainingPreempted(Exception):
    """Raised by :meth:`Trainer.fit` after a stop signal: the state is checkpointed.

    ``toolkit.run`` turns it into exit status 75 (``PREEMPTED_EXIT_CODE``), which
    ``slurm/train_preemptible.sbatch`` answers with ``scontrol requeue``.
    """

    def __init__(self, signame: str, step: int, path, elsewhere: bool = False):
        self.signame, self.step, self.path = signame, step, path
        where = " on another rank" if elsewhere else ""
        super().__init__(f"stopped by {signame}{where} after step {step}; checkpoint {path}; "
                         "rerun with --resume latest (a requeued job does so by itself)")


class StopAgreement:
    """Ranks agreeing to stop: a signal may reach ranks at different steps, so every
    ``check_every`` steps one tiny allreduce tells all of them which stop signals any rank
    got, and every rank then names the same one (Ctrl-C's SIGINT first: the user's own stop),
    so every rank exits with the same status."""

    def __init__(self, check_every: int, names: tuple[str, ...] = ()):
        self.check_every = check_every
        self.names = ("SIGINT", *(n for n in names if n != "SIGINT"))
        self.signal: str | None = None  # the signal this rank received, if any
        self.agreed_signal: str | None = None  # the one every rank names once they agree

    def note(self, signame: str) -> None:  # from the handler: the step in flight finishes first
        self.signal = signame

    def agreed(self, step: int, adapter: Any, distributed: bool) -> bool:
        """True on every rank as soon as any rank has received a stop signal."""
        local = np.asarray([float(self.signal == name) for name in self.names])
        if distributed:
            if step % self.check_every:  # the same steps on every rank
                return False
            local = adapter.allreduce(local, "sum")
        got = [name for name, count in zip(self.names, local, strict=True) if count > 0]
        if got:
            self.agreed_signal = got[0]
        return bool(got)


@contextlib.contextmanager
def noting_signals(names: tuple[str, ...], note: Callable[[str], None]) -> Iterator[None]:
    """Within the block, the signals ``names`` only call ``note(signal name)``, so the step in
    flight finishes first; the previous handlers are back afterwards. Outside the main thread
    it installs nothing (Python runs signal handlers in the main thread only)."""
    if not names or threading.current_thread() is not threading.main_thread():
        yield
        return

    noted: set[str] = set()

    def handler(signum, frame):
        noted.add(signal.Signals(signum).name)
        note(signal.Signals(signum).name)

    previous = {name: signal.signal(getattr(signal, name), handler) for name in names}
    try:
        yield
    finally:
        for name, old in previous.items():
            # Once a stop is under way, a second copy of the signal (a launcher forwards it to
            # the rank and its process group; Ctrl-C twice) must not kill the rank while it
            # reports: a default handler is replaced by "ignore" for a signal that came.
            if name in noted and old in (signal.SIG_DFL, signal.default_int_handler):
                old = signal.SIG_IGN
            signal.signal(getattr(signal, name), old)


def check_signals(names) -> None:
    """A ToolkitError for a name in ``names`` that is not a signal."""
    from toolkit.errors import ToolkitError

    for name in names:
        if not isinstance(getattr(signal, str(name), None), signal.Signals):
            raise ToolkitError(f"unknown signal {name!r} in stop_signals",
                               "use names such as 'SIGUSR1' and 'SIGTERM'")
