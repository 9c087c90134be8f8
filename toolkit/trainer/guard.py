"""The guard against divergence: a non-finite loss or gradient norm, or a loss that stays far
above its best, stops the run before a checkpoint is written from the bad state.

The Trainer hands the guard every step's loss after averaging it across ranks, so every rank
sees the same values and stops at the same step: none is left waiting in a collective.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from toolkit.errors import ToolkitError

DIVERGED_EXIT_CODE = 3  # toolkit.run's status for a diverged run (2: bad input, 75: preempted)


class TrainingDiverged(ToolkitError):
    """Raised by :meth:`Trainer.fit` when the loss diverges; nothing is saved from the bad
    state, so the newest checkpoint (``checkpoint``, None when none was written) is the last
    good one. ``toolkit.run`` turns it into exit status 3 (``DIVERGED_EXIT_CODE``)."""

    def __init__(self, step: int, loss: float, why: str, checkpoint):
        self.step, self.loss, self.checkpoint = step, loss, checkpoint
        last = (f"the last good checkpoint is {checkpoint}" if checkpoint is not None
                else "no checkpoint was written before it")
        super().__init__(
            f"training diverged at step {step}: the loss {loss:.6g} {why}; stopped with "
            f"nothing saved from that state ({last})",
            "resume from the last good checkpoint with a smaller learning rate (or more "
            "warm-up)")


class DivergenceGuard:
    """Checks each step's loss (averaged across ranks), in step order. ``above`` counts the
    consecutive latest steps above the factor (the Trainer holds scheduled checkpoints back
    while it is not 0).

    Args:
        factor: with a number > 1, a loss above ``factor`` x its running minimum for
            ``window`` consecutive steps counts as divergence (for losses that are positive,
            as cross-entropy and squared error are). None: only non-finite losses stop.
        window: how many consecutive steps above the factor stop the run.
        max_consecutive_skips: under ``on_nonfinite="skip"``, more consecutive skipped steps
            (steps whose gradient norm was not finite, so that nothing was updated) than this
            stop the run.
    """

    def __init__(self, factor: float | None = None, window: int = 20,
                 max_consecutive_skips: int = 5):
        if factor is not None and not (isinstance(factor, int | float) and math.isfinite(factor)
                                       and factor > 1):
            raise ToolkitError(f"divergence_factor={factor!r} is not a number above 1",
                               "use e.g. 10 (a loss 10x its best so far), or None to stop on "
                               "non-finite losses only")
        if not isinstance(window, int) or isinstance(window, bool) or window < 1:
            raise ToolkitError(f"divergence_window={window!r} is not a whole number >= 1",
                               "use the number of consecutive steps the loss must stay above "
                               "divergence_factor x its best, e.g. 20")
        if not isinstance(max_consecutive_skips, int) or isinstance(max_consecutive_skips, bool) \
                or max_consecutive_skips < 0:
            raise ToolkitError(f"max_consecutive_skips={max_consecutive_skips!r} is not a whole "
                               "number >= 0", "use e.g. 5: more consecutive skipped steps stop "
                               "the run")
        self.factor, self.window = factor, window
        self.max_skips = max_consecutive_skips
        self.best = math.inf
        self.above = 0  # consecutive steps above factor x best
        self.skips = 0  # consecutive skipped steps

    def state_dict(self) -> dict:
        """What a checkpoint records, so that a resumed run stops where an uninterrupted one
        would: the best loss so far and the current runs above it and of skipped steps."""
        return {"best": self.best if math.isfinite(self.best) else None, "above": self.above,
                "skips": self.skips}

    def load_state_dict(self, state: dict | None) -> None:
        """From a checkpoint's ``guard`` record (none in checkpoints without one)."""
        state = state or {}
        best = state.get("best")
        self.best = math.inf if best is None else float(best)
        self.above, self.skips = int(state.get("above", 0)), int(state.get("skips", 0))

    def check(self, first_step: int, losses: Sequence[float], norms: Sequence[float] = (),
              skipped: Sequence[bool] = (), overflow: Sequence[bool] = ()
              ) -> tuple[int, float, str] | None:
        """``(step, loss, why)`` of the first diverged step among ``losses`` (the steps after
        ``first_step``), their gradient ``norms`` (where the backend reports them), whether
        each was ``skipped``, and whether a loss scaler skipped it (``overflow``: its norm is
        the scaler's business; its loss is still checked), or None."""
        for i, loss in enumerate(losses):
            step, loss = first_step + i + 1, float(loss)
            if i < len(skipped) and skipped[i]:
                self.skips += 1
                if self.skips > self.max_skips:
                    many = f"{self.skips} consecutive steps were" if self.skips > 1 \
                        else "a step was"
                    return step, loss, (f"is not finite, and {many} skipped "
                                        f"(max_consecutive_skips={self.max_skips})")
                continue
            self.skips = 0
            if not math.isfinite(loss):
                return step, loss, "is not finite"
            scaler_skipped = i < len(overflow) and overflow[i]
            if i < len(norms) and not math.isfinite(norms[i]) and not scaler_skipped:
                return step, loss, f"is finite but the gradient norm {norms[i]} is not"
            if self.factor is None:
                continue
            if self.best > 0 and loss > self.factor * self.best:
                self.above += 1
                if self.above >= self.window:
                    return step, loss, (f"stayed above {self.factor:g} x its best "
                                        f"({self.best:.6g}) for {self.window} steps")
            else:
                self.above = 0
            self.best = min(self.best, loss)
        return None
