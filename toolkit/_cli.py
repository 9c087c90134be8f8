"""Running a training script so that errors are clear and a failing rank never hangs the job."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable

from toolkit._errors import ToolkitError
from toolkit._rank0 import current_env, eprint
from toolkit._trainer import PREEMPTED_EXIT_CODE, TrainingPreempted


def run(main: Callable[[], object]) -> None:
    """Calls ``main()`` and turns failures into a clear message and a non-zero exit.

    - A :class:`ToolkitError` (bad input) prints ``error: ...`` and its HINT (prefixed with
      the rank in multi-process jobs) and exits with status 2.
    - :class:`TrainingPreempted` (a stop signal; the state is checkpointed) exits with
      status 75 (``PREEMPTED_EXIT_CODE``), which a requeueing batch script looks for.
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
    try:
        main()
    except TrainingPreempted as stop:
        if env.rank == 0:
            eprint(f"preempted: {stop}")
        _exit(PREEMPTED_EXIT_CODE, env.is_distributed)
    except ToolkitError as err:
        # Every rank reports: the launcher may end the job the moment any rank exits, before
        # rank 0 has had its turn to print.
        prefix = f"[rank {env.rank}/{env.world_size}] " if env.is_distributed else ""
        eprint(f"{prefix}error: {err}")
        _exit(2, env.is_distributed)
    except KeyboardInterrupt:
        _exit(130, env.is_distributed)
    except BaseException as err:
        if isinstance(err, SystemExit) and err.code in (0, None):
            raise
        prefix = f"[rank {env.rank}/{env.world_size}] "
        text = "".join(traceback.format_exception(err))
        eprint("".join(prefix + line + "\n" for line in text.rstrip().splitlines()))
        eprint(f"{prefix}this rank failed; the launcher ends the job.")
        _exit(err.code if isinstance(err, SystemExit) and isinstance(err.code, int) else 1,
              env.is_distributed)


def _exit(code: int, distributed: bool) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    if distributed:
        os._exit(code)
    sys.exit(code)
