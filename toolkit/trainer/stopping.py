"""Leaving training together: a stop signal (checkpointed first) or a diverged loss ends
every rank at the same step, the watch closed and the communicator shut down in order."""

from __future__ import annotations

from toolkit.data.prefetch import BatchPrefetcher
from toolkit.trainer.guard import TrainingDiverged
from toolkit.trainer.preemption import TrainingPreempted


class StopsTogether:
    """The Trainer's ways out of its loop besides the end (a mixin: they use its state)."""

    def _stop_diverged(self, step: int, loss: float, why: str) -> None:
        """Every rank (each holds the same averaged losses) stops together, the newest
        checkpoint left as the last good one."""
        self._log.write([{"event": "diverged", "step": step, "loss": loss, "why": why}])
        last = self.checkpoints.newest()  # an asynchronous write of a good state completes
        self._leave_together()
        raise TrainingDiverged(step, loss, why, last)

    def _leave_together(self) -> None:
        """Every rank ends training at this point (no watch: they leave at different times).

        The communicator stays up: a script that catches the exception (a sweep trying the
        next learning rate, a notebook) builds its next Trainer on it, as after a run that
        ended well (an MPI finalised by ``hvd.shutdown`` cannot start again in the process).
        A process that exits shuts it down then, every rank at the same point: under
        :func:`toolkit.run` before its exit, else at the interpreter's exit (the frameworks'
        own ``atexit``)."""
        self._progress.clear()
        self._watch.close()
        self.adapter.barrier()

    def _stop_preempted(self, loader: BatchPrefetcher) -> None:
        """Every rank checkpoints this step and leaves together; the metrics log records it."""
        self._flush()
        self.prefetch_stats = loader.stats()
        self._log.write([{"event": "prefetch", **self.prefetch_stats}])
        path = self.save_checkpoint() or self.checkpoints.directory
        self.checkpoints.wait()
        signame = self._stop.agreed_signal  # the same on every rank
        self._log.write([{"event": "stopped", "signal": signame, "step": self.global_step,
                          "checkpoint": str(path)}])
        self._leave_together()
        raise TrainingPreempted(signame, self.global_step, path, self._stop.signal is None)

