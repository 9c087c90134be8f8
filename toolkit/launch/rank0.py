"""Rank-0 utilities: print once per job, write files atomically once per job.

``print0`` and ``save0`` act on the *global* rank 0 (not once per node, as some libraries do).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from toolkit.launch.env import LaunchEnv, detect_launch_env

_env: LaunchEnv | None = None


def current_env() -> LaunchEnv:
    """The launch environment of this process, detected on first use and then kept."""
    global _env
    if _env is None:
        _env = detect_launch_env()
    return _env


def _rank(env: LaunchEnv | None) -> int:
    return (env or current_env()).rank


def print0(*args: Any, env: LaunchEnv | None = None, **kwargs: Any) -> None:
    """``print`` on global rank 0 only; flushed, so lines from a launcher arrive in order.

    Args:
        *args: what ``print`` takes.
        env: the launch environment; the detected one when omitted.
        **kwargs: what ``print`` takes (``file``, ``end``, ...).
    """
    if _rank(env) == 0:
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


def fsync_dir(path: str | os.PathLike) -> None:
    """Makes a rename or file creation inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """Opens a temporary file beside ``path``; on success it is fsynced and renamed to ``path``.

    A crash (or an exception inside the ``with`` block) at any moment leaves either the old
    file or the new one under ``path``, never a half-written one; the temporary file is removed.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def save0(
    path: str | os.PathLike,
    data: bytes | str | Callable[[IO[bytes]], None],
    *,
    env: LaunchEnv | None = None,
) -> bool:
    """Writes ``data`` to ``path`` atomically, on global rank 0 only.

    Args:
        path: the final file name; its folder is created when missing.
        data: bytes, a string (written as UTF-8), or a function that writes to a binary file
            object (for example ``lambda f: numpy.save(f, array)``).
        env: the launch environment; the detected one when omitted.

    Returns:
        True on the rank that wrote, False on the others.

    Example:
        >>> save0("/tmp/model.npz", lambda f: numpy.savez(f, **weights))  # doctest: +SKIP
    """
    if _rank(env) != 0:
        return False
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(path, "wb") as f:
        if callable(data):
            data(f)
        else:
            f.write(data.encode() if isinstance(data, str) else data)
    return True


def eprint(*args: Any) -> None:
    """Prints to stderr, flushed (for errors every rank must report), in one write: an
    unbuffered stream (PYTHONUNBUFFERED) would otherwise write the newline apart, and a
    launcher that tags each write (mpirun --tag-output) would tag it as a line of its own."""
    sys.stderr.write(" ".join(str(a) for a in args) + "\n")
    sys.stderr.flush()
