"""The shared sampler: every backend and every world size sees the same global minibatches."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from toolkit.errors import ToolkitError


class GlobalBatchSampler:
    """Hands each rank its part of the global minibatches of sequential training.

    Each epoch one permutation is drawn from ``(seed, epoch)``, identical on every rank. Global
    minibatch ``k`` is ``perm[k*B:(k+1)*B]``, exactly what one process training with batch ``B``
    sees; rank ``r`` of ``N`` takes the strided part ``[r::N]`` of it. So data-parallel training
    on ``N`` ranks with local batch ``B/N`` and averaged gradients equals sequential training with
    batch ``B``, whatever ``N`` is.

    Iterating yields this rank's index arrays from the current position to the end of the
    epoch, then moves to the next epoch by itself; :meth:`set_epoch` is only needed to jump.
    :meth:`state_dict` records the position in global minibatches, so a run can resume
    mid-epoch on a different number of ranks.

    Uneven dataset sizes:
        ``drop_last=True`` (default) drops the last ``num_samples % B`` samples of each epoch's
        permutation (a different set each epoch when shuffling). ``drop_last=False`` pads the
        last global minibatch to ``B`` with the first samples of the same permutation, so those
        few samples are seen twice in that epoch.

    Args:
        num_samples: size of the data set.
        global_batch_size: ``B``, the samples in one step across all ranks.
        world_size: ``N``; must divide ``B``.
        rank: this process's global rank.
        shuffle: draw a new permutation each epoch; otherwise samples go in order.
        seed: seeds the permutations (the same on every rank).
        drop_last: see above.

    Example (the classic one: 24 samples, global batch 8, 2 ranks, no shuffle):
        >>> s = GlobalBatchSampler(24, 8, world_size=2, rank=1, shuffle=False)
        >>> [b.tolist() for b in s][1]
        [9, 11, 13, 15]
    """

    def __init__(
        self,
        num_samples: int,
        global_batch_size: int,
        *,
        world_size: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
    ):
        if num_samples < 1:
            raise ToolkitError(f"the data set is empty (num_samples={num_samples})",
                               "check the data you passed to the sampler")
        if global_batch_size < 1:
            raise ToolkitError(f"global batch size {global_batch_size} must be positive",
                               "pass --batch-size with a positive multiple of the world size")
        if global_batch_size % world_size:
            lo = max(world_size, global_batch_size // world_size * world_size)
            raise ToolkitError(
                f"global batch size {global_batch_size} is not divisible by the world size "
                f"{world_size}",
                f"use a multiple of {world_size}, such as {lo} or {lo + world_size}",
            )
        if drop_last and global_batch_size > num_samples:
            raise ToolkitError(
                f"global batch size {global_batch_size} is larger than the data set "
                f"({num_samples} samples), so drop_last leaves no step",
                f"use a batch of at most {num_samples} samples, or drop_last=False",
            )
        if not 0 <= rank < world_size:
            raise ToolkitError(f"rank {rank} is outside a world of size {world_size}",
                               "take rank and world size from the same LaunchEnv")
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.world_size = world_size
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.step = 0  # global minibatches of `epoch` already handed out
        # [(epoch, its order)]: one slot, shared by copies (the prefetch thread's), replaced
        # whole so a reader never sees half of it.
        self._order: list[tuple[int, np.ndarray] | None] = [None]

    @property
    def local_batch_size(self) -> int:
        """Samples this rank works on per step, ``B / N``."""
        return self.global_batch_size // self.world_size

    def __len__(self) -> int:
        """Steps (global minibatches) per epoch."""
        if self.drop_last:
            return self.num_samples // self.global_batch_size
        return math.ceil(self.num_samples / self.global_batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Moves to the start of ``epoch``."""
        self.epoch, self.step = int(epoch), 0

    def epoch_order(self, epoch: int) -> np.ndarray:
        """All sample indices of ``epoch`` in the order their global minibatches take them.

        Drawn once per epoch (a permutation of a large data set takes milliseconds) and kept,
        read-only, for the epoch; copies of the sampler share it.
        """
        cached = self._order[0]
        if cached is not None and cached[0] == epoch:
            return cached[1]
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
        else:
            order = np.arange(self.num_samples)
        needed = len(self) * self.global_batch_size
        if needed > self.num_samples:  # drop_last=False: pad from the start of the same order
            order = np.resize(order, needed)
        order = order[:needed]
        order.flags.writeable = False
        self._order[0] = (epoch, order)
        return order

    def global_batch(self, epoch: int, step: int) -> np.ndarray:
        """The indices of global minibatch ``step`` of ``epoch`` (all ranks' samples)."""
        if not 0 <= step < len(self):
            raise IndexError(f"step {step} outside an epoch of {len(self)} steps")
        b = self.global_batch_size
        return self.epoch_order(epoch)[step * b:(step + 1) * b]

    def __iter__(self) -> Iterator[np.ndarray]:
        epoch, b = self.epoch, self.global_batch_size
        order = self.epoch_order(epoch)
        for step in range(self.step, len(self)):
            # The position moves before the batch is handed out, so a checkpoint written after
            # this step resumes past it; after the last batch it is already the next epoch's
            # start, even if the caller stops iterating there.
            if step + 1 == len(self):
                self.set_epoch(epoch + 1)
            else:
                self.step = step + 1
            # A copy: the epoch's order is shared and read-only, the caller's batch is its own.
            yield order[step * b:(step + 1) * b][self.rank::self.world_size].copy()

    def state_dict(self) -> dict[str, Any]:
        """The position, independent of world size and rank: plain JSON-able values."""
        return {
            "epoch": self.epoch,
            "step": self.step,
            "num_samples": self.num_samples,
            "global_batch_size": self.global_batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict[str, Any], allow_changes: bool = False) -> None:
        """Resumes at the saved position; the world size may differ from the saving run's.

        Args:
            state: from :meth:`state_dict`.
            allow_changes: accept another global batch size, seed or ordering (the user
                changes the run on purpose): the position moves to the first global minibatch
                not yet fully seen, counted in samples of the epoch.

        Raises:
            ToolkitError: when the saved run used other data (always), or another batch
                size, seed or ordering (unless ``allow_changes``), so resuming would not
                continue the same sequence of minibatches.
        """
        keys = ("num_samples",) if allow_changes else (
            "num_samples", "global_batch_size", "seed", "shuffle", "drop_last")
        for key in keys:
            if key in state and state[key] != getattr(self, key):
                raise ToolkitError(
                    f"the saved sampler state has {key}={state[key]!r}, this run has "
                    f"{key}={getattr(self, key)!r}",
                    "resume with the same data set, global batch size, seed and shuffle "
                    "settings as the run that saved it (the world size may differ)",
                )
        self.epoch = int(state["epoch"])
        saved_batch = int(state.get("global_batch_size", self.global_batch_size))
        self.step = int(state["step"]) * saved_batch // self.global_batch_size
        if self.step >= len(self):
            self.set_epoch(self.epoch + 1)


    def check_accumulation(self, steps: int) -> None:
        """A ToolkitError unless the local batch splits into ``steps`` micro-batches."""
        if self.local_batch_size % steps:
            raise ToolkitError(
                f"the local batch of {self.local_batch_size} samples (global "
                f"{self.global_batch_size} / {self.world_size} data-parallel shares) does not "
                f"split into accumulation_steps={steps} micro-batches",
                "choose a global batch divisible by world size x accumulation steps")


def shard_indices(num_samples: int, world_size: int, rank: int) -> np.ndarray:
    """The strided share ``[rank::world_size]`` of ``range(num_samples)`` (for evaluation).

    Shares differ by at most one sample; sum metrics and counts across ranks to get the exact
    result of evaluating everything in one process.
    """
    return np.arange(rank, num_samples, world_size)  # never the whole range at once
