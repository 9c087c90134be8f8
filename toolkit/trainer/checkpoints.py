"""The Trainer's checkpoints and stop signals: saving, resuming, and stopping every rank at
the same step (a mixin of :class:`toolkit.Trainer`, which holds the attributes these read)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from toolkit.checkpoint.resume import describe as _describe
from toolkit.checkpoint.resume import find_checkpoint, restore
from toolkit.checkpoint.settings import (
    classify,
    describe_changes,
    refuse_changes,
    run_settings,
    saved_settings,
)
from toolkit.errors import ToolkitError
from toolkit.launch.rank0 import print0
from toolkit.trainer.guard import TrainingDiverged


class Checkpointing:
    """``save_checkpoint``, resuming at set-up, the checkpoint schedule and the stop-signal
    agreement of the Trainer."""

    def _restore(self) -> None:
        ckpt = find_checkpoint(self.resume, self.store)
        if ckpt is None:  # (created on the first save: a mistyped parent shows here)
            if not Path(self.checkpoint_dir).exists():
                print0(f"{self.checkpoint_dir} does not exist: starting a new run there",
                       env=self.env)
            else:
                print0(f"no checkpoint in {self.checkpoint_dir} yet: starting from step 0",
                       env=self.env)
            return
        trajectory, placement = classify(saved_settings(ckpt.meta), self._settings())
        # The checkpoint's structure first (another model's tensors: which ones do not fit),
        # then its settings; either error leaves every checkpoint as it was.
        restore(ckpt, self.adapter, self.sampler, self._data_fingerprint(),
                allow_changes=bool(trajectory))
        if not self.allow_changes:
            refuse_changes(ckpt.path, trajectory)
        self.global_step = self._last_saved = ckpt.step  # that step is saved already
        self._resumed_from = ckpt.path
        print0(f"resumed from {ckpt.path} (step {ckpt.step}, written by "
               f"{ckpt.meta.get('backend')} on {ckpt.meta.get('world_size')} ranks)",
               env=self.env)
        self._changes = list(ckpt.meta.get("changes", []))
        if placement:
            print0(f"resumed on another placement: {describe_changes(placement)}",
                   env=self.env)
        if trajectory:  # allowed: said, and recorded in every later checkpoint and the log
            print0(f"resumed with changed settings (allowed): {describe_changes(trajectory)}",
                   env=self.env)
            record = {"step": ckpt.step, "changes": [list(c) for c in trajectory]}
            self._changes.append(record)
            self._log_records([{"event": "changes", **record}])

    def _settings(self) -> dict:
        return run_settings(
            model=_describe(self.model), optimizer=_describe(self.optimizer),
            global_batch_size=self.global_batch_size, seed=self.seed, shuffle=self.shuffle,
            drop_last=self.drop_last, lr_scaling=self.lr_scaling, backend=self.adapter.name,
            layout=self.layout.name, world_size=self.env.world_size,
            clip_grad_norm=self.clip_grad_norm)

    def _data_fingerprint(self) -> str | None:  # asked late: computing one may read a corpus
        return getattr(self._train_data, "fingerprint", None)

    def _note_stop_signal(self, signame: str) -> None:  # the step in flight finishes first
        self._stop_signal = signame

    def _stop_agreed(self) -> bool:
        """True on every rank as soon as any rank has received a stop signal."""
        local = np.asarray([1.0 if self._stop_signal else 0.0])
        if not self.env.is_distributed:
            return bool(local[0])
        if self.global_step % self.stop_check_every:  # the same steps on every rank
            return False
        return bool(self.adapter.allreduce(local, "sum")[0] > 0)

    def _loss_settled(self) -> bool:
        """False while the loss is above ``divergence_factor`` x its best: a scheduled
        checkpoint waits, so that the newest one predates a divergence found later."""
        self._flush()
        return not self._guard.above

    def _stop_diverged(self, step: int, loss: float, why: str) -> None:
        """Every rank (each holds the same averaged losses) stops together, the newest
        checkpoint left as the last good one."""
        self._log_records([{"event": "diverged", "step": step, "loss": loss, "why": why}])
        last = None
        if self.store is not None:
            self.store.wait()  # an asynchronous write of a good state completes
            newest = self.store.checkpoints()
            last = newest[-1] if newest else None
        self._progress.clear()
        self.adapter.barrier()
        self.adapter.shutdown()
        raise TrainingDiverged(step, loss, why, last)

    def _checkpoint_due(self, last_time: float) -> bool:
        if self.store is None:
            return False
        if self.checkpoint_every and self.global_step % self.checkpoint_every == 0:
            return True
        if self.checkpoint_every_seconds is not None:
            # Every rank must agree, or rank 0 would save while others move on: rank 0's clock
            # decides, and the decision is broadcast only on the steps that ask.
            due = float(time.monotonic() - last_time >= self.checkpoint_every_seconds)
            return bool(self.adapter.broadcast(np.asarray([due]), 0)[0])
        return False

    def save_checkpoint(self) -> Path | None:
        """Writes the current state (rank 0 writes replicated state; returns its path there).
        The steps since the last check pass the divergence guard first."""
        if self.store is None:
            raise ToolkitError("no checkpoint directory was given", "pass checkpoint_dir=...")
        if getattr(self, "_pending", None):
            self._flush()  # raises TrainingDiverged before a diverged state is saved
        meta = {
            "epoch": self.sampler.epoch,
            "sampler": self.sampler.state_dict(),
            "world_size": self.env.world_size,
            "backend": self.adapter.name,
            "layout": self.layout.name,
            "rng": {"seed": self.seed},  # all randomness (init, shuffling) derives from it
            "model": _describe(self.model),
            "optimizer": _describe(self.optimizer),
            "data_fingerprint": self._data_fingerprint(),  # resuming on other data fails
            "settings": self._settings(),  # compared on resume
            "changes": self._changes,  # settings changed on purpose at earlier resumes
        }
        self._last_saved = self.global_step
        self.adapter.sync_state()
        if self.layout.collective_forward:  # every rank writes its own pieces
            replicated, pieces = self.adapter.sharded_state()
            return self.store.save(self.global_step, replicated, meta, shards=pieces,
                                   barrier=self.adapter.barrier)
        return self.store.save(self.global_step, self.adapter.state_dict(), meta,
                               blocking=not self.async_checkpoint)
