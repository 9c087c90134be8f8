"""The adapter contract: what every backend implements, with one signature everywhere.

A backend adapter owns its framework's communicator, model and optimizer; the Trainer owns the
loop, the sampler, metrics, checkpoints and printing. Data crosses the boundary as numpy arrays
and floats, state as named numpy arrays (the checkpoint format's names), so the Trainer never
imports a framework.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import numpy as np

from toolkit.launch.env import LaunchEnv
from toolkit.models.specs import OptimizerSpec


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one training step returns: the only values the Trainer reads of a step.

    Args:
        loss: this rank's mean loss over its local batch: a float, or a framework scalar that
            ``float()`` reads (the Trainer converts it when it averages losses, so a step need
            not wait for the device).
        grad_norm: the whole model's gradient norm before clipping, when the step was built
            with ``clip_grad_norm`` or ``skip_nonfinite`` (None otherwise); a framework scalar
            until ``float()``.
        skipped: with ``skip_nonfinite``, whether the step's norm was not finite and nothing
            was updated (no parameter, optimizer slot, count or statistic).
        loss_scale: the loss scale the step used under fp16 loss scaling (any power of two,
            1.0 and below included), None without a loss scaler.
        overflow: under fp16 loss scaling, whether the scaled gradient was not finite: the
            update was skipped (``skipped`` is True too) and the scale lowered. Such skips
            are the scaler's, not the divergence guard's.

    Example:
        >>> StepResult.of(0.25)
        StepResult(loss=0.25, grad_norm=None, skipped=False, loss_scale=None, overflow=False)
        >>> float(StepResult(0.5, grad_norm=2.0))
        0.5
    """

    loss: Any
    grad_norm: Any = None
    skipped: Any = False
    loss_scale: float | None = None
    overflow: bool = False

    @classmethod
    def of(cls, value: Any) -> StepResult:
        """``value`` if it is a StepResult, else a plain loss as one (an adapter of one's own
        may return just its loss)."""
        return value if isinstance(value, StepResult) else cls(value)

    def __float__(self) -> float:
        return float(self.loss)


@runtime_checkable
class Adapter(Protocol):
    """One backend. Methods are called in this order: setup, build, then steps and collectives,
    then shutdown.

    Attributes:
        name: the backend's registry name, e.g. ``horovod-torch``.
        layouts: the kinds of layout it runs (``toolkit.DataParallel.kind``, ``Sharded.kind``,
            ``Pipeline.kind``); without the attribute, data parallelism only.
    """

    name: str

    def setup(self, env: LaunchEnv, layout: Any = None, device: str = "auto") -> None:
        """Initialises the framework's communicator for ``env`` and ``layout`` (a
        ``toolkit.DataParallel``, ``Sharded`` or ``Pipeline``; None is data parallel: what
        ``build`` then creates is laid out as it says) on ``device`` (``auto``, ``cpu``,
        ``gpu``: ``toolkit.launch.devices.choose_device``); checks the communicator agrees
        with ``env``."""

    def build(self, model: Any, optimizer: OptimizerSpec | Any, loss: Any, *,
              seed: int = 0, accumulation_steps: int = 1, sync_batchnorm: bool = False,
              metrics: dict[str, Any] | None = None) -> None:
        """Builds the model and optimizer and makes rank 0's initial state everyone's.

        Args:
            model: a spec (e.g. :class:`toolkit.MLP`, initialised from ``seed``) or the
                framework's native model.
            optimizer: an optimizer spec, or the framework's native optimizer.
            loss: ``cross_entropy``, ``mse`` or a callable of the framework,
                ``loss(outputs, labels) -> per-sample losses`` (shape ``(batch,)``).
            seed: seeds the spec's numpy initialisation.
            accumulation_steps: micro-batches each local batch is split into; gradients are
                summed over them and averaged across ranks once per step.
            sync_batchnorm: BatchNorm statistics over the global batch (see Trainer).
            metrics: name -> callable of the framework, ``fn(outputs, labels) -> per-sample
                values`` (shape ``(batch,)``); :meth:`evaluate` returns their sums by name.

        Two options are passed only when the user asks for them, so an adapter without them
        still serves every other run: ``clip_grad_norm=c`` (clip each step's averaged
        gradient by its whole-model norm; the step's :class:`StepResult` then carries that
        norm, before clipping, as ``grad_norm``) and ``skip_nonfinite=True`` (a step whose
        norm is not finite updates nothing; its result then says ``skipped``).
        docs/architecture.md#build-options-a-strategy-declares.
        """

    def train_step(self, x: np.ndarray, y: np.ndarray, lr: float) -> StepResult:
        """One optimizer step on this rank's local batch; returns its :class:`StepResult`
        (the local mean loss, and the norm and skip the build options ask for).

        Gradients are averaged across ranks before the update, so every rank applies the same
        update. ``lr`` is this step's learning rate (the Trainer evaluates schedules).
        """

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
        """Local sums over ``x``: ``loss_sum``, ``correct`` (classification), ``count``, and
        one sum per metric given to :meth:`build`, by its name."""

    def allreduce(self, values: np.ndarray, op: str = "mean") -> np.ndarray:
        """Reduces a host array across ranks (``mean`` or ``sum``); every rank gets the result."""

    def broadcast(self, values: np.ndarray, root: int = 0) -> np.ndarray:
        """Rank ``root``'s copy of a host array, on every rank."""

    def barrier(self) -> None:
        """Returns once every rank has called it."""

    def sync_state(self) -> None:
        """Makes rank 0's non-trained model state (BatchNorm statistics) every rank's.

        Called by the Trainer on every rank before it evaluates and before it checkpoints, so
        results and checkpoints never depend on which rank evaluated what. A no-op for models
        without such state (and when synchronised batch norm keeps the ranks equal anyway).
        """

    def state_dict(self) -> dict[str, np.ndarray]:
        """Model and optimizer state as named host arrays (``params/...``, ``opt/...``,
        ``buffers/...`` for non-trained model state such as BatchNorm statistics)."""

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """Replaces model and optimizer state with ``state`` (from :meth:`state_dict`)."""

    def shutdown(self) -> None:
        """Releases the communicator."""


@runtime_checkable
class ShardedAdapter(Protocol):
    """The optional ability to keep the training state sharded over ranks (``toolkit.Sharded``):
    ZeRO stage 1 shards the optimizer state, stage 2 also the gradients (reduce-scatter instead
    of allreduce), stage 3 also the parameters (FSDP: gathered just before use, freed after).

    A parameter's shard is a slice of its unit's flat, padded buffer
    (``toolkit.parallel.shards.FlatLayout``): rank r of N owns elements [r*L, (r+1)*L).
    ``state_dict`` and ``load_state_dict`` keep speaking full tensors (gathered on every rank), so
    any layout
    loads any checkpoint; checkpoints of a sharded run are written by every rank from
    :meth:`sharded_state`, never gathered onto rank 0.
    """

    def sharded_state(self) -> tuple[dict[str, np.ndarray],
                                     dict[str, tuple[np.ndarray, int, tuple[int, ...]]]]:
        """``(replicated, pieces)``: tensors every rank holds whole (written by rank 0) and this
        rank's flat pieces of sharded tensors, ``name -> (piece, 0, full shape)`` under the full
        tensors' neutral names (``params/...``, ``opt/<slot>/...``)."""

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds between steps for ``params``, ``grads`` and ``optimizer``
        state, counted from its own tensors' sizes (not from a formula)."""


@runtime_checkable
class PipelineAdapter(Protocol):
    """The optional ability to run ``toolkit.Pipeline``: the model cut into stages, ``S x D``
    ranks as ``D`` data-parallel replicas of an ``S``-stage pipeline.

    ``setup`` receives the layout (a backend may need it when its communicator starts: Horovod's
    process sets); the step then runs the layout's schedule on this rank's stage.
    ``state_dict`` and ``load_state_dict`` keep speaking the full model (gathered on every
    rank), so any layout loads any checkpoint; checkpoints of a pipeline run are written by
    every rank from :meth:`sharded_state` (each tensor whole from the stage that owns it, empty
    pieces from the other ranks), never gathered onto rank 0.
    """

    def pipeline_position(self) -> tuple[int, int]:
        """This rank's ``(stage, replica)`` (``(0, rank)`` without a pipeline layout)."""

    def sharded_state(self) -> tuple[dict[str, np.ndarray],
                                     dict[str, tuple[np.ndarray, int, tuple[int, ...]]]]:
        """``(replicated, pieces)`` as ``ShardedAdapter.sharded_state``."""

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank (its stage) holds for ``params``, ``grads`` and ``optimizer``."""


@runtime_checkable
class DrivesDevices(Protocol):
    """The optional ability to say which devices each process drives (JAX: a process may
    drive several; without this ability, one), and in which dtype. The Trainer asks after
    ``setup``: with the layout, it decides which share of each global batch this process
    loads (``Layout.data_share``), and it says what runs."""

    dtype_name: str  # the compute dtype, e.g. "float32"

    def local_device_count(self) -> int:
        """Devices this process computes on (the same number in every process)."""

    def device_names(self) -> list[str]:
        """This process's devices as the framework names them (e.g. ``["cpu"]``)."""


@runtime_checkable
class PlacesBatches(Protocol):
    """The optional ability to copy a batch to the backend's devices ahead of its step.

    The Trainer calls :meth:`device_batch` on each loaded batch: in its prefetch thread when
    that runs (``Trainer(prefetch=...)``), so the copy overlaps the step running before it,
    else on the training thread; ``train_step`` takes what it returned, as well as host
    arrays.
    """

    def device_batch(self, x: np.ndarray, y: np.ndarray) -> tuple[Any, Any]:
        """``(x, y)`` as ``train_step`` will use them (checked as ``train_step`` checks them);
        safe to call from another thread while a step runs."""
