"""A run's checkpoints: where they go, when one is due, what goes into one, and what a resume
restores or refuses. The Trainer holds one :class:`RunCheckpoints` and tells it, at set-up,
the adapter, sampler and launch environment it works with and how to describe the run."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from toolkit.checkpoint.resume import directory_contents, find_checkpoint, restore
from toolkit.checkpoint.settings import (
    classify,
    describe_changes,
    refuse_changes,
    saved_settings,
)
from toolkit.checkpoint.store import CheckpointStore
from toolkit.errors import ToolkitError
from toolkit.launch.rank0 import print0


def nothing_to_resume(directory: Path) -> str:
    """Why ``directory`` has no checkpoint to resume, naming what it found."""
    what = directory_contents(directory)
    if what.startswith("holds "):
        return f"{directory} holds no checkpoint (it {what})"
    return f"the checkpoint directory {directory} {what}"


class RunCheckpoints:
    """The checkpoint side of one training run.

    Args:
        directory: where checkpoints go (``None``: no checkpoints).
        every: a checkpoint every this many steps; every_seconds: or this many seconds.
        keep: how many to keep.
        resume: ``"latest"`` (the newest checkpoint in ``directory``; an error when there is
            none, so a mistyped path never starts over), ``"auto"`` (the newest if there is
            one, else a new run: a requeued job's script) or a checkpoint's path.
        async_write: write in a background thread.
        allow_changes: resume even when the settings that define the trajectory differ.
    """

    def __init__(self, directory: str | os.PathLike | None, *, every: int | None = None,
                 every_seconds: float | None = None, keep: int = 3,
                 resume: str | os.PathLike | None = None, async_write: bool = False,
                 allow_changes: bool = False):
        if resume is not None and directory is None and str(resume) in ("latest", "auto"):
            raise ToolkitError(f"resume={str(resume)!r} needs a checkpoint directory",
                               f"pass --checkpoint-dir DIR together with --resume {resume}")
        self.directory, self.every, self.every_seconds = directory, every, every_seconds
        self.keep, self.resume, self.async_write = keep, resume, async_write
        self.allow_changes = allow_changes
        self.store: CheckpointStore | None = None
        self.changes: list[dict] = []  # settings changed on purpose at resumes
        self.resumed_from: Path | None = None  # the checkpoint this run continues, if any
        self.last_saved = -1  # the step of the newest checkpoint this run wrote
        self._clock = time.monotonic()

    def open(self, adapter: Any, sampler: Any, env: Any, layout: Any,
             describe_run: Callable[[], dict]) -> None:
        """Binds the run's parts; ``describe_run()`` gives what a checkpoint records of the
        run besides them (model and optimizer, ``settings``, ``data_fingerprint``, ...)."""
        self.adapter, self.sampler, self.env, self.layout = adapter, sampler, env, layout
        self._describe_run = describe_run
        if self.directory is not None:
            self.store = CheckpointStore(self.directory, keep=self.keep, rank=env.rank)

    # ------------------------------------------------------------------------ resuming
    def restore(self, log_records: Callable[[list[dict]], None]) -> Any:
        """Loads the checkpoint ``resume`` names into the adapter and the sampler, refusing
        changed settings unless allowed; returns it (``None``: a fresh start)."""
        if self.resume is None:
            return None
        ckpt = find_checkpoint("latest" if str(self.resume) == "auto" else self.resume,
                               self.store)
        if ckpt is None and str(self.resume) == "latest":
            raise ToolkitError(f"--resume latest: {nothing_to_resume(Path(self.directory))}",
                               "check the path (a new run's first start, as a requeued job's, "
                               "takes --resume auto: the newest checkpoint if there is one, "
                               "else step 0)")
        if ckpt is None:  # resume="auto" and nothing yet: said in the start-up block
            return None
        env = self.env
        run = self._describe_run()
        trajectory, placement = classify(saved_settings(ckpt.meta), run["settings"])
        # The checkpoint's structure first (another model's tensors: which ones do not fit),
        # then its settings; either error leaves every checkpoint as it was.
        restore(ckpt, self.adapter, self.sampler, run["data_fingerprint"],
                allow_changes=bool(trajectory))
        if not self.allow_changes:
            refuse_changes(ckpt.path, trajectory)
        # that step is saved already, if in this run's directory (resumed from elsewhere, the
        # state at the end still goes there)
        here = self.store is not None and ckpt.path.parent.resolve() == \
            self.store.directory.resolve()
        self.last_saved = ckpt.step if here else -1
        self.resumed_from = ckpt.path
        print0(f"resumed from {ckpt.path} (step {ckpt.step}, written by "
               f"{ckpt.meta.get('backend')} on {ckpt.meta.get('world_size')} ranks)", env=env)
        self.changes = list(ckpt.meta.get("changes", []))
        if placement:
            print0(f"resumed on another placement: {describe_changes(placement)}", env=env)
        if trajectory:  # allowed: said, and recorded in every later checkpoint and the log
            print0(f"resumed with changed settings (allowed): {describe_changes(trajectory)}",
                   env=env)
            record = {"step": ckpt.step, "changes": [list(c) for c in trajectory]}
            self.changes.append(record)
            log_records([{"event": "changes", **record}])
        return ckpt

    # ------------------------------------------------------------------------ saving
    def start_clock(self) -> None:
        self._clock = time.monotonic()

    def due(self, step: int) -> bool:
        """Whether the schedule asks for a checkpoint after ``step`` (the same on every rank)."""
        if self.store is None:
            return False
        if self.every and step % self.every == 0:
            return True
        if self.every_seconds is not None:
            # Every rank must agree, or rank 0 would save while others move on: rank 0's clock
            # decides, and the decision is broadcast only on the steps that ask.
            due = float(time.monotonic() - self._clock >= self.every_seconds)
            return bool(self.adapter.broadcast(np.asarray([due]), 0)[0])
        return False

    def unsaved(self, step: int) -> bool:
        """Whether the state at ``step`` still needs writing at the end of training: the same
        answer on every rank (never a look at the directory, where rank 0's write of that
        step may still be under way while another rank looks)."""
        return self.store is not None and self.last_saved != step

    def save(self, step: int) -> Path | None:
        """Writes the state at ``step`` (rank 0 writes replicated state; its path there)."""
        if self.store is None:
            raise ToolkitError("no checkpoint directory was given", "pass checkpoint_dir=...")
        meta = {"epoch": self.sampler.epoch, "sampler": self.sampler.state_dict(),
                "world_size": self.env.world_size, "backend": self.adapter.name,
                "layout": self.layout.name, **self._describe_run(),
                "changes": self.changes}  # settings changed on purpose at earlier resumes
        self.last_saved = step
        self._clock = time.monotonic()
        self.adapter.sync_state()
        if self.layout.collective_forward:  # every rank writes its own pieces
            replicated, pieces = self.adapter.sharded_state()
            return self.store.save(step, replicated, meta, shards=pieces,
                                   barrier=self.adapter.barrier)
        return self.store.save(step, self.adapter.state_dict(), meta,
                               blocking=not self.async_write)

    def wait(self) -> None:
        """Until an asynchronous write has completed."""
        if self.store is not None:
            self.store.wait()

    def newest(self) -> Path | None:
        """The newest complete checkpoint on disk, after any write in flight."""
        if self.store is None:
            return None
        self.store.wait()
        found = self.store.checkpoints()
        return found[-1] if found else None
