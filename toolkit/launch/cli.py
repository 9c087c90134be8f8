"""Running a training script so that errors are clear and a failing rank never hangs the job."""

from __future__ import annotations

import argparse
import difflib
import os
import re
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable

from toolkit.errors import ToolkitError
from toolkit.launch.rank0 import current_env, eprint
from toolkit.trainer.guard import DIVERGED_EXIT_CODE, TrainingDiverged
from toolkit.trainer.trainer import PREEMPTED_EXIT_CODE, TrainingPreempted

INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT, what a shell reports for Ctrl-C

# How long the other ranks wait before exiting on a usage error or bad input, so that rank 0
# prints it before the launcher (which ends the job when any rank exits) can stop it.
USAGE_GRACE_SECONDS = 3.0
# How long rank 0 stays after saying it, so that ranks a little behind reach the same verdict
# (and exit quietly when the launcher ends them) before the launcher stops them mid-start.
RANK0_LINGER_SECONDS = 1.0


# Shutdowns of the communicators this process started (``close_on_input_error``), called before
# a rank exits on bad input: a Horovod peer whose partner vanished without one logs a
# "Connection reset by peer" error from its background thread before the launcher ends it.
_CLOSERS: list[Callable[[], object]] = []
CLOSE_TIMEOUT_SECONDS = 5.0


def close_on_input_error(close: Callable[[], object]) -> None:
    """Registers ``close`` (a communicator's shutdown) to be called, for at most
    ``CLOSE_TIMEOUT_SECONDS``, when :func:`run` ends a rank on a mistake in the user's input
    or after training stopped on every rank together (a stop signal, a diverged loss). Every
    rank reaches that verdict alike, so the shutdown cannot wait on a rank that goes on.
    """
    if close not in _CLOSERS:
        _CLOSERS.append(close)


def _close() -> None:
    def close_all():
        for close in reversed(_CLOSERS):
            try:
                close()
            except Exception:  # already down, or never fully up: exiting anyway
                pass

    closer = threading.Thread(target=close_all, name="toolkit-close", daemon=True)
    closer.start()
    closer.join(CLOSE_TIMEOUT_SECONDS)


class UsageError(Exception):
    """A command-line mistake found by :class:`ArgumentParser` (printed once by :func:`run`)."""

    def __init__(self, usage: str, message: str):
        super().__init__(message)
        self.usage, self.message = usage, message


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser for scripts every rank runs: ``--help`` shows each option's default,
    and help and usage errors are printed once per job (by rank 0), not once per rank.

    A usage error raises :class:`UsageError`; under :func:`run` it prints the usage line and
    the message on rank 0 and exits with status 2 on every rank, without a traceback.

    Example:
        >>> p = ArgumentParser(prog="train.py")
        >>> _ = p.add_argument("--steps", type=int, default=1500, help="training steps")
        >>> "(default: 1500)" in p.format_help()
        True
    """

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args, **kwargs):
        # argparse shows a default only beside a help text: give every option one.
        if kwargs.get("help") is None and kwargs.get("default") not in (None, argparse.SUPPRESS):
            kwargs["help"] = "(default: %(default)s)"
        return super().add_argument(*args, **kwargs)

    def error(self, message: str):
        usage = self.format_usage()
        if usage.count("\n") > 2:  # a script with many options: the mistake, not a page
            usage = f"usage: {self.prog} [-h] [options]  ({self.prog} --help lists them)\n"
        raise UsageError(usage, f"{self.prog}: error: {did_you_mean(message)}")

    def _print_message(self, message, file=None):
        if _rank() == 0:
            super()._print_message(message, file)


def did_you_mean(message: str) -> str:
    """argparse's ``invalid choice`` ``message`` with the choice the user most likely meant.

    Example:
        >>> did_you_mean("argument --precision: invalid choice: 'bf16' (choose from '32', "
        ...              "'64', 'bf16-mixed', 'fp16-mixed')").endswith("; did you mean bf16-mixed?")
        True
    """
    found = re.search(r"invalid choice: '(.*?)' \(choose from (.*)\)$", message)
    if not found:
        return message
    given = found[1]
    choices = [c.strip().strip("'") for c in found[2].split(",")]  # (quoted before 3.12.8)
    near = ([c for c in choices if given in c]
            or difflib.get_close_matches(given, choices, n=1, cutoff=0.5))
    return f"{message}; did you mean {near[0]}?" if near else message


def _rank() -> int:
    try:
        return current_env().rank
    except ToolkitError:  # an inconsistent launch: run() reports it
        return 0


def run(main: Callable[[], object]) -> None:
    """Calls ``main()`` and turns failures into a clear message and a non-zero exit.

    - A :class:`UsageError` (a command-line mistake) prints the usage line and the message
      once, on rank 0, and exits with status 2 on every rank.
    - A :class:`ToolkitError` (bad input) prints ``error: ...`` and its HINT once, on rank 0,
      and exits with status 2 on every rank (a rank that failed alone says it itself).
    - :class:`TrainingPreempted` (a stop signal; the state is checkpointed) exits with
      status 75 (``PREEMPTED_EXIT_CODE``), which a requeueing batch script looks for; after
      Ctrl-C (SIGINT) with status 130, the user's own stop.
    - :class:`TrainingDiverged` (a non-finite or runaway loss; nothing saved from that state)
      prints its message once, on rank 0, and exits with status 3 (``DIVERGED_EXIT_CODE``).
    - Any other exception prints the traceback prefixed with the rank that failed and exits
      with status 1 at once, skipping interpreter shutdown: the framework's communicator could
      otherwise wait forever for the other ranks, and the launcher (horovodrun, mpirun, srun)
      ends the whole job when one rank exits non-zero.
    """
    try:
        env = current_env()
    except ToolkitError as err:
        eprint(f"error: {err}")
        sys.exit(2)
    if env.is_distributed and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        # A launcher ending the job (another rank failed) sends SIGTERM; dying of it makes the
        # shell between horovodrun and this rank print "Terminated". Exit with the same status
        # quietly instead (a Trainer with a checkpoint directory handles it while it trains).
        signal.signal(signal.SIGTERM, lambda *_: os._exit(128 + signal.SIGTERM))
    try:
        main()
    except TrainingPreempted as stop:
        # Ctrl-C is the user's own stop (status 130, as for any interrupted program); the
        # other signals are the scheduler's, answered by requeueing on status 75.
        interrupted = stop.signame == "SIGINT"
        if env.rank == 0:
            eprint(f"{'interrupted' if interrupted else 'preempted'}: {stop}")
        _close()  # (every rank left training together: the communicators shut down in order)
        _exit(INTERRUPTED_EXIT_CODE if interrupted else PREEMPTED_EXIT_CODE, env.is_distributed)
    except TrainingDiverged as err:  # every rank holds the same losses and stops together
        if env.rank == 0:
            eprint(f"error: {err}")
        _close()
        _exit(DIVERGED_EXIT_CODE, env.is_distributed)
    except UsageError as err:
        _said_by_rank0(env, err.usage.rstrip() + "\n" + err.message, alone=None)
    except ToolkitError as err:
        _said_by_rank0(env, f"error: {err}", alone=f"error: {err}")
    except KeyboardInterrupt:  # Ctrl-C outside a Trainer that checkpoints
        if env.rank == 0:
            eprint("interrupted by SIGINT: nothing saved (a Trainer with a checkpoint "
                   "directory stops at a step boundary and checkpoints instead)")
        _exit(INTERRUPTED_EXIT_CODE, env.is_distributed)
    except BaseException as err:
        if isinstance(err, SystemExit) and err.code in (0, None):
            raise
        prefix = f"[rank {env.rank}/{env.world_size}] "
        text = "".join(traceback.format_exception(err))
        eprint("".join(prefix + line + "\n" for line in text.rstrip().splitlines()))
        eprint(f"{prefix}this rank failed; the launcher ends the job.")
        _exit(err.code if isinstance(err, SystemExit) and isinstance(err.code, int) else 1,
              env.is_distributed)


def _said_by_rank0(env, text: str, alone: str | None) -> None:
    """Says a mistake in the user's input once, on rank 0, and exits with status 2.

    Every rank reaches the same verdict from the same input, so the others say nothing: rank 0
    stays a second (ranks a little behind reach the verdict meanwhile); the others wait a
    moment longer, so that a launcher which ends the job as soon as one rank exits cannot stop
    rank 0 before it has printed, and exit with status 2 when the launcher ends them. A rank
    still running after that wait failed alone (a file or GPU its node lacks) and says
    ``alone`` itself, prefixed with its rank.
    """
    if env.rank == 0:
        eprint(text)
        _close()
        if env.is_distributed:
            time.sleep(RANK0_LINGER_SECONDS)
    elif env.is_distributed:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: os._exit(2))
        _close()
        time.sleep(USAGE_GRACE_SECONDS)
        if alone is not None:
            eprint(f"[rank {env.rank}/{env.world_size}] {alone}")
    _exit(2, env.is_distributed)


def _exit(code: int, distributed: bool) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    if distributed:
        os._exit(code)
    sys.exit(code)
