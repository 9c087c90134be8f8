"""The checkpoint store: one framework-neutral format, written atomically, verified on load.

Layout of a store directory::

    DIR/
      latest                   -> text file naming the newest complete checkpoint
      step_000000060/
        manifest.json          format, version, step, metadata, and per tensor: name, file,
                               shape, dtype, crc32
        00000.npy 00001.npy .. the tensors, numpy's documented .npy format (no pickle: loading
                               a checkpoint never runs code)

A checkpoint is written into a hidden temporary directory, every file flushed and fsynced, then
renamed into place; ``latest`` is replaced atomically last. A crash at any instant leaves the old
checkpoint or the new one complete, never a half one under a final name.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from toolkit._errors import ToolkitError
from toolkit._rank0 import atomic_open, eprint, fsync_dir

FORMAT = "hpc-toolkit-checkpoint"
FORMAT_VERSION = 1
_PREFIX = "step_"


class CheckpointError(ToolkitError):
    """A checkpoint that cannot be written or read; names the file and what to do."""


def _crc32(array: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(array).view(np.uint8).reshape(-1)) & 0xFFFFFFFF


def _step_dir_name(step: int) -> str:
    return f"{_PREFIX}{step:09d}"


class Checkpoint:
    """A loaded checkpoint: ``tensors`` (name -> array), ``meta`` (JSON values) and ``path``."""

    def __init__(self, path: Path, tensors: dict[str, np.ndarray], meta: dict[str, Any]):
        self.path, self.tensors, self.meta = path, tensors, meta

    @property
    def step(self) -> int:
        return int(self.meta["step"])


class CheckpointStore:
    """Saves and loads checkpoints in one directory (on shared storage for multi-node jobs).

    Args:
        directory: where checkpoints live; created on the first save.
        keep: how many of the newest checkpoints to keep (older ones are deleted after a
            successful save; the one just written is never deleted).
        rank: this process's global rank. Replicated state is written by rank 0 only.

    Example:
        >>> store = CheckpointStore("/tmp/ckpt", keep=2)                  # doctest: +SKIP
        >>> store.save(60, {"params/w": w}, {"epoch": 1})               # doctest: +SKIP
        >>> store.load("latest").tensors["params/w"]                     # doctest: +SKIP
    """

    def __init__(self, directory: str | os.PathLike, *, keep: int = 3, rank: int = 0):
        if keep < 1:
            raise CheckpointError(f"keep={keep} would delete every checkpoint",
                                  "keep at least 1 (the default is 3)")
        self.directory = Path(directory)
        self.keep = keep
        self.rank = rank
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    # ----------------------------------------------------------------------------- writing
    def save(self, step: int, tensors: Mapping[str, np.ndarray], meta: Mapping[str, Any], *,
             blocking: bool = True) -> Path | None:
        """Writes checkpoint ``step`` (rank 0 only; other ranks return None at once).

        Args:
            step: the global step the state belongs to (names the directory).
            tensors: name -> array; copied to host memory before this returns.
            meta: JSON-serialisable metadata (epoch, sampler state, backend, ...).
            blocking: False writes in a background thread so training continues; the next
                save (or :meth:`wait`) waits for it and re-raises its error, if any.

        Returns:
            The checkpoint's final path on rank 0.
        """
        self.wait()
        if self.rank != 0:
            return None
        meta = json.loads(json.dumps(dict(meta)))  # a private copy, and fail early if not JSON
        if blocking:
            return self._write(step, {n: np.asarray(v) for n, v in tensors.items()}, meta)
        # Training goes on and may change the arrays in place: the writer gets copies.
        host = {name: np.array(value, copy=True) for name, value in tensors.items()}

        def work() -> None:
            try:
                self._write(step, host, meta)
            except BaseException as err:  # re-raised in the training thread by wait()
                self._error = err

        self._thread = threading.Thread(target=work, name=f"checkpoint-{step}", daemon=False)
        self._thread.start()
        return self.directory / _step_dir_name(step)

    def wait(self) -> None:
        """Waits for a background save to finish; re-raises its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def _write(self, step: int, tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> Path:
        final = self.directory / _step_dir_name(step)
        tmp = self.directory / f".tmp.{final.name}.{os.getpid()}"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            entries = []
            for i, (name, array) in enumerate(tensors.items()):
                if array.dtype.hasobject:
                    raise CheckpointError(f"tensor {name!r} has dtype object, which .npy can only "
                                          "store with pickle", "store numeric arrays only")
                file = f"{i:05d}.npy"
                with open(tmp / file, "wb") as f:
                    np.lib.format.write_array(f, array, allow_pickle=False)
                    f.flush()
                    os.fsync(f.fileno())
                entries.append({"name": name, "file": file, "shape": list(array.shape),
                                "dtype": array.dtype.str, "crc32": _crc32(array)})
            manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "step": step,
                        **meta, "tensors": entries}
            with open(tmp / "manifest.json", "w") as f:
                json.dump(manifest, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(tmp)
            if final.exists():  # re-saving a step: move the old one aside, then swap
                old = self.directory / f".old.{final.name}.{os.getpid()}"
                os.rename(final, old)
                os.rename(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp, final)
            fsync_dir(self.directory)
            with atomic_open(self.directory / "latest", "w") as f:
                f.write(final.name + "\n")
        except OSError as err:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(
                f"could not write checkpoint {final}: {err.strerror or err}",
                "check that the directory is writable and has free space (the previous "
                "checkpoint is untouched)",
            ) from err
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._prune(keep_also=final)
        return final

    def _prune(self, keep_also: Path) -> None:
        paths = self.checkpoints()
        for path in paths[: max(0, len(paths) - self.keep)]:
            if path != keep_also:
                shutil.rmtree(path, ignore_errors=True)

    # ----------------------------------------------------------------------------- reading
    def checkpoints(self) -> list[Path]:
        """Checkpoint directories present, oldest first (intact or not)."""
        if not self.directory.is_dir():
            return []
        found = [p for p in self.directory.iterdir()
                 if p.is_dir() and p.name.startswith(_PREFIX) and p.name[len(_PREFIX):].isdigit()]
        return sorted(found, key=lambda p: int(p.name[len(_PREFIX):]))

    def load(self, which: str | os.PathLike = "latest") -> Checkpoint:
        """Loads and verifies a checkpoint.

        Args:
            which: ``"latest"`` for the newest intact checkpoint in this store (falling back,
                with a message, past damaged ones), or the path of one checkpoint directory
                (verified strictly: damage is an error).

        Raises:
            CheckpointError: no checkpoint, or the one asked for is damaged, of an unknown
                format version, or unreadable; the message names the file.
        """
        if str(which) != "latest":
            return read_checkpoint(Path(which))
        candidates = self.checkpoints()[::-1]
        pointer = self.directory / "latest"
        with contextlib.suppress(OSError):
            named = self.directory / pointer.read_text().strip()
            if named in candidates:  # the pointer's choice first, then newest to oldest
                candidates.remove(named)
                candidates.insert(0, named)
        if not candidates:
            raise CheckpointError(f"no checkpoint in {self.directory}",
                                  "train with a checkpoint directory first, or drop --resume")
        problems = []
        for path in candidates:
            try:
                ckpt = read_checkpoint(path)
            except CheckpointError as err:
                problems.append(err.message)
                continue
            if problems and self.rank == 0:
                eprint(f"[checkpoint] skipped damaged checkpoint(s): {'; '.join(problems)}; "
                       f"resuming from {path}")
            return ckpt
        raise CheckpointError(f"no intact checkpoint in {self.directory}: {'; '.join(problems)}",
                              "resume from an earlier copy, or start without --resume")


def read_checkpoint(path: Path) -> Checkpoint:
    """Reads one checkpoint directory, verifying format, version, shapes, dtypes and checksums."""
    manifest_path = path / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{manifest_path} does not exist",
                              "pass a step_* directory written by this toolkit") from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{manifest_path} is unreadable or truncated ({err})",
                              "resume from another checkpoint") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{manifest_path} is not a {FORMAT} manifest",
                              "pass a step_* directory written by this toolkit")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{manifest_path} has format version {version!r}; this toolkit reads version "
            f"{FORMAT_VERSION}", "load it with the toolkit version that wrote it")
    tensors = {}
    for entry in manifest["tensors"]:
        file = path / entry["file"]
        try:
            array = np.load(file, allow_pickle=False)
        except (OSError, ValueError, EOFError) as err:
            raise CheckpointError(f"{file} (tensor {entry['name']!r}) is unreadable or "
                                  f"truncated ({err})", "resume from another checkpoint") from None
        if list(array.shape) != entry["shape"] or array.dtype.str != entry["dtype"]:
            raise CheckpointError(
                f"{file} (tensor {entry['name']!r}) holds {array.dtype.str}{list(array.shape)}, "
                f"the manifest says {entry['dtype']}{entry['shape']}",
                "resume from another checkpoint")
        if _crc32(array) != entry["crc32"]:
            raise CheckpointError(f"{file} (tensor {entry['name']!r}) fails its checksum",
                                  "the file is corrupted; resume from another checkpoint")
        tensors[entry["name"]] = array
    meta = {k: v for k, v in manifest.items() if k != "tensors"}
    return Checkpoint(path, tensors, meta)
