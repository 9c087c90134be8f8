"""Node-local staging: one verified copy of a file from shared storage on each node.

Reading a data set from a shared file system on every pass makes every rank of every node load
it, and the file system's servers with it; reading a copy on the node's own disk costs the
shared file system one read per node. :func:`stage` makes that copy once per node: local rank 0
copies the file under a temporary name of its own, checks the copy's SHA-256 against the bytes
it read, renames it into place and writes a marker beside it; the other local ranks poll the
file system for that marker. No collective is involved, so staging works before any backend is
set up.

For a source ``/shared/corpus.npy`` the local directory holds::

    <local_dir>/toolkit-staged/<key>/corpus.npy           the copy
    <local_dir>/toolkit-staged/<key>/corpus.npy.staged    the marker (JSON, below)
    <local_dir>/toolkit-staged/<key>/.corpus.npy.<host>-<pid>-<token>.tmp   a copy in progress

``key`` is a hash of the source's absolute path, so two sources named alike do not collide. The
marker records the copy's SHA-256, the source's size and modification time when it was copied,
and the copy's inode, size and modification time as local rank 0 verified them.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import itertools
import json
import os
import re
import secrets
import socket
import time
from pathlib import Path

from toolkit.errors import ToolkitError
from toolkit.launch.env import LaunchEnv
from toolkit.launch.rank0 import atomic_open, current_env, fsync_dir

LOCAL_DIR_VARIABLES = ("SLURM_TMPDIR", "TMPDIR")  # in the order they are tried
STAGED_FOLDER = "toolkit-staged"
_CHUNK = 8 << 20
_TOUCH_EVERY = 32  # chunks hashed between two signs of progress for the waiting ranks
_TEMPORARY = re.compile(r"-(?P<pid>\d+)-[0-9a-f]{8}\.tmp$")


def stage(path: str | os.PathLike, local_dir: str | os.PathLike | None = None, *,
          env: LaunchEnv | None = None, sha256: str | None = None,
          timeout: float = 300.0) -> Path:
    """Copies ``path`` to node-local storage once per node and returns the local copy's path.

    Every rank of the job calls it with the same arguments. Local rank 0 of each node copies
    the file (streamed in chunks, hashed with SHA-256 as it is read), hashes the copy again,
    renames it into place only when both hashes agree, and writes a marker holding the hash;
    the other local ranks wait until the marker describes the copy. A copy left by an earlier
    job is re-used, without reading the source, when its marker names the source's current size
    and modification time (rsync's quick check) and the copy still has the marker's hash; any
    other copy (stale, damaged, half-written) is replaced.

    Nodes that share one "local" directory (``$TMPDIR`` on shared storage by mistake) do not
    corrupt each other's copy: each writes under a temporary name of its own (host, process)
    and only a verified copy is renamed into place, atomically; they merely copy more than once.

    Args:
        path: the file on shared storage (any file: a packed ``.npy`` corpus, an archive).
        local_dir: the node-local directory; default ``$SLURM_TMPDIR``, else ``$TMPDIR``.
        env: the launch environment (local rank and size); the detected one when omitted.
        sha256: the source's expected SHA-256 (hex), when known: a source with another hash is
            an error, and a copy is re-used only when it has this hash.
        timeout: seconds the other local ranks wait without a sign of progress from local
            rank 0 (its copy growing or being hashed) before giving up with an error.

    Returns:
        The local copy: ``<local_dir>/toolkit-staged/<key>/<file name>``, the same on every
        rank of a node.

    Raises:
        ToolkitError: the source is missing or unreadable, no local directory is given or set,
            it cannot be written, the source does not have ``sha256`` or changed while being
            copied, the copy does not match, or local rank 0 showed no progress for
            ``timeout`` seconds (on the waiting ranks).

    Example:
        >>> local = stage("/shared/corpus.npy")                          # doctest: +SKIP
        >>> tokens = np.load(local, mmap_mode="r")                        # doctest: +SKIP
    """
    env = env or current_env()
    source = _readable_source(path)
    base, origin = _local_dir(local_dir)
    _check_writable(base, origin)
    key = hashlib.sha256(str(source).encode()).hexdigest()[:12]
    target = base / STAGED_FOLDER / key / source.name
    info = source.stat()
    wanted = {"source": str(source), "source_bytes": info.st_size,
              "source_mtime_ns": info.st_mtime_ns}
    expected = sha256.lower() if sha256 else None
    if env.local_rank == 0:
        return _stage_here(source, target, wanted, expected, origin)
    return _wait_for(target, wanted, expected, timeout)


def _readable_source(path: str | os.PathLike) -> Path:
    source = Path(os.path.abspath(path))
    if source.is_dir():
        raise ToolkitError(f"cannot stage {source}: it is a directory, and stage copies one file",
                           "pack the data set into one file (a .npy corpus, a tar archive) and "
                           "stage that")
    try:
        with open(source, "rb"):
            pass
    except OSError as err:
        raise ToolkitError(f"cannot stage {source}: {err.strerror or err}",
                           "pass the path of the data set on shared storage, as every node "
                           "sees it") from None
    return source


def _local_dir(local_dir: str | os.PathLike | None) -> tuple[Path, str]:
    """The node-local directory and how it was chosen (for messages)."""
    if local_dir is not None and str(local_dir):
        return Path(os.path.abspath(local_dir)), f"local_dir={local_dir}"
    for name in LOCAL_DIR_VARIABLES:
        value = os.environ.get(name, "")
        if value:
            return Path(os.path.abspath(value)), f"${name}={value}"
    raise ToolkitError("no node-local directory to stage to: neither "
                       f"{' nor '.join(LOCAL_DIR_VARIABLES)} is set",
                       "pass stage(path, local_dir=...) (--stage-data DIR in the examples) "
                       "naming a directory on each node's own disk")


def _check_writable(base: Path, origin: str) -> None:
    """Every rank checks, so that all of them fail at once rather than wait for rank 0."""
    hint = ("name a writable directory on each node's own disk (not shared storage), with "
            "local_dir=... or --stage-data DIR")
    existing = base
    while not existing.exists():  # the first existing folder on the way up
        existing = existing.parent
    if not existing.is_dir():
        raise ToolkitError(f"cannot stage into {base} ({origin}): {existing} is not a directory",
                           hint)
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ToolkitError(f"cannot stage into {base} ({origin}): {existing} is not writable",
                           hint)


def _stage_here(source: Path, target: Path, wanted: dict, expected: str | None,
                origin: str) -> Path:
    """Local rank 0: re-use a verified copy, or make one."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ToolkitError(f"cannot create {target.parent} ({origin}): {err.strerror or err}",
                           "name a writable directory on each node's own disk with "
                           "local_dir=... or --stage-data DIR") from None
    _remove_abandoned_copies(target)
    host = socket.gethostname()
    marker = _read_marker(target)
    if _describes(marker, wanted, expected) and target.exists() \
            and _sha256_of(target) == marker["sha256"]:
        if marker["file"] != _identity(target):  # another node's verified copy, renamed in
            _write_marker(target, marker)
        print(f"staging: {host} re-uses {target} ({_size(wanted['source_bytes'])}, sha256 "
              f"{marker['sha256'][:16]}... verified)", flush=True)
        return target
    began = time.perf_counter()
    digest = _copy_verified(source, target, wanted, expected, origin)
    seconds = time.perf_counter() - began
    _write_marker(target, {**wanted, "sha256": digest, "host": host, "pid": os.getpid(),
                           "seconds": round(seconds, 3), "finished": time.time()})
    print(f"staging: {host} copied {source} to {target} ({_size(wanted['source_bytes'])} in "
          f"{seconds:.2f} s, sha256 {digest[:16]}... verified)", flush=True)
    return target


def _copy_verified(source: Path, target: Path, wanted: dict, expected: str | None,
                   origin: str) -> str:
    """Copies into a temporary name of this process, checks, renames; returns the SHA-256."""
    tmp = target.with_name(f".{target.name}.{socket.gethostname()}-{os.getpid()}-"
                           f"{secrets.token_hex(4)}.tmp")
    digest = hashlib.sha256()
    try:
        with open(source, "rb") as src, open(tmp, "xb") as dst:
            buffer = bytearray(_CHUNK)
            view = memoryview(buffer)
            while n := src.readinto(buffer):
                digest.update(view[:n])
                dst.write(view[:n])
            dst.flush()
            os.fsync(dst.fileno())
        read = digest.hexdigest()
        now = source.stat()
        if (now.st_size, now.st_mtime_ns) != (wanted["source_bytes"], wanted["source_mtime_ns"]):
            raise ToolkitError(f"{source} changed while it was being staged",
                               "stage the data set once it is completely written")
        if expected and read != expected:
            raise ToolkitError(f"{source} has sha256 {read}, not the expected {expected}",
                               "the data set on shared storage differs from the one you named: "
                               "check which version it is, or pass its current hash")
        copied = _sha256_of(tmp, touch=True)
        if copied != read:
            raise ToolkitError(f"the copy of {source} in {tmp.parent} has sha256 {copied}, but "
                               f"the bytes read had {read}",
                               f"the node-local disk ({origin}) may be failing: name another "
                               "directory, or report the node")
        os.replace(tmp, target)  # atomic: a reader sees the old file or the verified copy
        fsync_dir(target.parent)
    except OSError as err:
        raise ToolkitError(f"staging {source} to {target.parent} failed: {err.strerror or err}",
                           f"check the free space of the node-local directory ({origin}) and "
                           "that the source stays readable") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return read


def _write_marker(target: Path, fields: dict) -> None:
    """Writes the marker for the file now under ``target``, until the two agree.

    Every writer renames only a verified copy into place, so whatever file is there is a good
    one; where nodes share the directory, another node's rename may land between this stat
    and this marker, and the loop then describes its file instead."""
    marker = target.with_name(target.name + ".staged")
    for _ in range(100):
        file = _identity(target)
        with atomic_open(marker, "w") as f:
            json.dump({**fields, "file": file}, f, indent=1)
        marker.chmod(0o644)  # readable by every user of the node, as the copy is
        if _identity(target) == file:
            return


def _wait_for(target: Path, wanted: dict, expected: str | None, timeout: float) -> Path:
    """The other local ranks: poll until the marker describes the file under ``target``."""
    deadline, progress, pause = time.monotonic() + timeout, None, 0.01
    while True:
        marker = _read_marker(target)
        if _describes(marker, wanted, expected) and _identity(target) == marker.get("file"):
            return target
        now = _copies_in_progress(target)
        if now != progress:  # a copy grew or was hashed: local rank 0 is alive
            progress, deadline = now, time.monotonic() + timeout
        if time.monotonic() > deadline:
            raise ToolkitError(
                f"local rank 0 showed no progress staging {wanted['source']} to {target} for "
                f"{timeout:g} s",
                "look for local rank 0's error in the job's output (it may have crashed), or "
                "pass a larger stage(..., timeout=...) for a slow disk")
        time.sleep(pause)
        pause = min(0.5, pause * 2, timeout / 4)


def _describes(marker: dict | None, wanted: dict, expected: str | None) -> bool:
    """Whether the marker is of the source as it is now (and of the expected hash)."""
    return (marker is not None and all(marker.get(k) == v for k, v in wanted.items())
            and (expected is None or marker.get("sha256") == expected)
            and isinstance(marker.get("file"), dict)
            and marker["file"].get("bytes") == wanted["source_bytes"])


def _read_marker(target: Path) -> dict | None:
    try:
        marker = json.loads(target.with_name(target.name + ".staged").read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def _identity(path: Path) -> dict | None:
    try:
        info = path.stat()
    except FileNotFoundError:
        return None
    return {"ino": info.st_ino, "bytes": info.st_size, "mtime_ns": info.st_mtime_ns}


def _copies_in_progress(target: Path) -> list[tuple]:
    found = []
    for tmp in target.parent.glob(f".{glob.escape(target.name)}.*.tmp"):
        with contextlib.suppress(FileNotFoundError):
            info = tmp.stat()
            found.append((tmp.name, info.st_size, info.st_mtime_ns))
    return sorted(found)


def _remove_abandoned_copies(target: Path) -> None:
    """Removes this host's temporary copies whose process is gone (a crashed earlier job)."""
    host = socket.gethostname()
    for tmp in target.parent.glob(f".{glob.escape(target.name)}.{glob.escape(host)}-*.tmp"):
        match = _TEMPORARY.search(tmp.name)
        if match and not _alive(int(match.group("pid"))):
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _sha256_of(path: Path, touch: bool = False) -> str:
    """SHA-256 of a file, read in chunks; ``touch``: its modification time moves now and then,
    the sign of progress the waiting ranks watch while a large copy is hashed."""
    digest = hashlib.sha256()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb") as f:
        for chunks in itertools.count(1):
            n = f.readinto(buffer)
            if not n:
                break
            digest.update(view[:n])
            if touch and chunks % _TOUCH_EVERY == 0:
                os.utime(path)
    return digest.hexdigest()


def _size(n: int) -> str:
    return f"{n / 1e6:,.1f} MB" if n >= 100_000 else f"{n:,} bytes"
