"""The checkpoint store: one framework-neutral format, written atomically, verified on load.

Layout of a store directory::

    DIR/
      latest                   -> text file naming the newest complete checkpoint
      step_000000060/
        manifest.json          format, version, step, metadata, and per tensor: name, file,
                               shape, dtype, crc32
        00000.npy 00001.npy .. the tensors, numpy's documented .npy format (no pickle: loading
                               a checkpoint never runs code)
        shard-r00001-00000.npy per-rank pieces of sharded tensors: each rank writes its own;
                               the manifest entry says which piece (index) along which axis

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
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from toolkit.errors import ToolkitError
from toolkit.launch.rank0 import atomic_open, eprint, fsync_dir

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
             blocking: bool = True, shards: Mapping[str, tuple[np.ndarray, int]] | None = None,
             barrier: Callable[[], None] | None = None) -> Path | None:
        """Writes checkpoint ``step`` (rank 0 only; other ranks return None at once).

        Args:
            step: the global step the state belongs to (names the directory).
            tensors: name -> array; copied to host memory before this returns.
            meta: JSON-serialisable metadata (epoch, sampler state, backend, ...).
            blocking: False writes in a background thread so training continues; the next
                save (or :meth:`wait`) waits for it and re-raises its error, if any.
            shards: this rank's pieces of sharded tensors, ``name -> (piece, axis)`` or
                ``name -> (piece, axis, full_shape)``. Every rank calls ``save`` with its own
                pieces and writes its own files; loading concatenates the pieces in rank order
                along ``axis`` (and reshapes to ``full_shape``: flat pieces of a flattened
                tensor, possibly empty, as ZeRO/FSDP shards are), so the full tensor can be
                re-split onto any number of ranks. Needs ``barrier`` and ``blocking=True``.
            barrier: returns once every rank has called it (e.g. ``adapter.barrier``).

        Returns:
            The checkpoint's final path on rank 0.
        """
        self.wait()
        if shards is not None:
            if barrier is None or not blocking:
                raise CheckpointError("sharded saves need a barrier and blocking=True",
                                      "pass barrier=adapter.barrier")
            return self._write_sharded(step, tensors, meta, shards, barrier)
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

    def _write(self, step: int, tensors: dict[str, np.ndarray], meta: dict[str, Any],
               tmp: Path | None = None, shard_entries: list[dict] | None = None) -> Path:
        final = self.directory / _step_dir_name(step)
        shared_tmp = tmp is not None
        tmp = tmp or self.directory / f".tmp.{final.name}.{os.getpid()}"
        try:
            if not shared_tmp:
                self.directory.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
            entries = _write_arrays(tmp, tensors, "{i:05d}.npy") + (shard_entries or [])
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

    def _write_sharded(self, step, tensors, meta, shards, barrier) -> Path | None:
        """Every rank writes its pieces into one shared temporary directory; rank 0 then
        writes the replicated tensors and the manifest naming every piece, and renames."""
        tmp = self.directory / f".tmp.{_step_dir_name(step)}.shared"
        error: BaseException | None = None
        if self.rank == 0:
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
            except OSError as err:
                error = err
        barrier()
        try:
            if error is None:
                pieces = {name: spec[0] for name, spec in shards.items()}
                mine = _write_arrays(tmp, pieces, f"shard-r{self.rank:05d}-{{i:05d}}.npy")
                for entry in mine:
                    spec = shards[entry["name"]]
                    entry["shard"] = {"index": self.rank, "axis": int(spec[1])}
                    if len(spec) > 2:  # a flat piece: the full tensor's shape to restore
                        entry["shard"]["shape"] = [int(d) for d in spec[2]]
                with open(tmp / f"shards-r{self.rank:05d}.json", "w") as f:
                    json.dump(mine, f)
                    f.flush()
                    os.fsync(f.fileno())
        except OSError as err:
            error = err
        barrier()  # every rank's pieces are on disk
        path = None
        if self.rank == 0 and error is None:
            listed = sorted(tmp.glob("shards-r*.json"))
            entries = [e for file in listed for e in json.loads(file.read_text())]
            meta = {**json.loads(json.dumps(dict(meta))), "shard_ranks": len(listed)}
            path = self._write(step, {n: np.asarray(v) for n, v in tensors.items()}, meta,
                               tmp=tmp, shard_entries=entries)
        barrier()  # nobody moves on before the checkpoint is complete
        if error is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"could not write the shards of checkpoint step {step} in "
                                  f"{self.directory}: {error}", "check that the directory "
                                  "is writable and has free space (the previous checkpoint "
                                  "is untouched)") from error
        return path

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


def _write_arrays(folder: Path, tensors: Mapping[str, np.ndarray], pattern: str) -> list[dict]:
    """Writes each array as an fsynced .npy file; returns their manifest entries."""
    entries = []
    for i, (name, array) in enumerate(tensors.items()):
        if array.dtype.hasobject:
            raise CheckpointError(f"tensor {name!r} has dtype object, which .npy can only "
                                  "store with pickle", "store numeric arrays only")
        file = pattern.format(i=i)
        with open(folder / file, "wb") as f:
            np.lib.format.write_array(f, array, allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())
        entries.append({"name": name, "file": file, "shape": list(array.shape),
                        "dtype": array.dtype.str, "crc32": _crc32(array)})
    return entries


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
    tensors: dict[str, np.ndarray] = {}
    pieces: dict[str, list] = {}
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
        if "shard" in entry:
            pieces.setdefault(entry["name"], []).append((entry["shard"], array))
        else:
            tensors[entry["name"]] = array
    expected_pieces = manifest.get("shard_ranks", 0)
    for name, parts in pieces.items():
        parts.sort(key=lambda part: part[0]["index"])
        if [p[0]["index"] for p in parts] != list(range(expected_pieces)):
            raise CheckpointError(
                f"{path}: tensor {name!r} has pieces {[p[0]['index'] for p in parts]}, "
                f"expected one from each of {expected_pieces} ranks",
                "the checkpoint is incomplete; resume from another checkpoint")
        whole = np.concatenate([a for _, a in parts], axis=parts[0][0]["axis"])
        if "shape" in parts[0][0]:
            shape = tuple(parts[0][0]["shape"])
            if whole.size != int(np.prod(shape)):
                raise CheckpointError(
                    f"{path}: the pieces of tensor {name!r} hold {whole.size} values, its "
                    f"shape {list(shape)} needs {int(np.prod(shape))}",
                    "the checkpoint is incomplete; resume from another checkpoint")
            whole = whole.reshape(shape)
        tensors[name] = whole
    meta = {k: v for k, v in manifest.items() if k != "tensors"}
    return Checkpoint(path, tensors, meta)
