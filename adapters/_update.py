"""The host side of the one update path, the same in every framework family.

Each family writes the update once, on its devices (``adapters/_jax/update.py``,
``adapters/horovod_torch/update.py``, ``adapters/horovod_tf/update.py``), and every layout of
the family calls it, pipelines included: the layout supplies the reduced gradient and how the
squares of the whole gradient add up, then

    unscale -> norm -> clip and finite check -> apply -> the old state kept when skipped.

What stays on the host is this class, :class:`UpdateRule`: the build's ``clip_grad_norm`` and
``skip_nonfinite``, a spec optimizer's step count (Adam's ``t``) and each step's optimizer
scalars, and, after the step, its :class:`toolkit.StepResult` (taking the count back for a
skipped step). Every strategy of every backend keeps one, so the bookkeeping of a skipped step
exists once.

Whether a step was skipped is known only on the device, from its gradient's norm. A rule made
with ``defer=True`` never reads it there step by step (a read waits for the step, which stops
the host from queueing the next one): the step carries :class:`Deferred` scalars instead, whose
:class:`Counters` (the loss scale, its clean steps, the skips so far) the device advances
itself, and whose table holds Adam's scalars for every count the skips could have left. The
host learns the skips when the Trainer reads the step's :class:`DeviceValue` values at its flush,
and takes its own count and scale from the counters every :data:`WINDOW` steps (Adam) or when
a checkpoint asks (:meth:`UpdateRule.counters`). A rule made without ``defer`` reads the norm
after each step (:meth:`UpdateRule.result`): the pipelines' steps, whose executors wait on the
host anyway, and horovod-torch's with an optimizer that cannot skip on a device flag.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from adapters._common import nonfinite
from toolkit import SGD, Adam
from toolkit.contract import StepResult
from toolkit.models.reference import adam_scalars
from toolkit.precision import LossScaler


class StepScalars(NamedTuple):
    """One step's numbers from the host, read by name in every compiled step.

    ``lr``; Adam's ``step_size`` and ``c2_sqrt`` (``toolkit.models.reference.adam_scalars``;
    SGD and native optimizers: 0 and 1); ``loss_scale`` (1 without loss scaling). They travel
    as one vector in this order (:meth:`vector`: one host-to-device copy per step) and are
    read back by name inside the step (:meth:`of`).

    Example:
        >>> StepScalars.of(StepScalars(0.1, 0.0, 1.0, 8.0).vector("float32")).loss_scale
        np.float32(8.0)
    """

    lr: Any
    step_size: Any
    c2_sqrt: Any
    loss_scale: Any

    def vector(self, dtype) -> np.ndarray:
        """The scalars as one vector of ``dtype``."""
        return np.asarray(self, dtype)

    @classmethod
    def of(cls, vector: Any) -> StepScalars:
        """The named view of a :meth:`vector` (a numpy, TF or JAX vector, or a traced one)."""
        return cls(*(vector[i] for i in range(len(cls._fields))))

    @classmethod
    def zeros(cls, dtype) -> np.ndarray:
        """A vector shaped as every step's (for compiling ahead)."""
        return np.zeros(len(cls._fields), dtype)


WINDOW = 32
"""Deferred steps between two host reads of the counters when Adam's count depends on them
(the length of :class:`Deferred`'s table)."""


class Counters(NamedTuple):
    """What a deferred step reads and advances on the device, as one vector in this order: the
    loss scale (1 without a scaler), its clean steps since it last changed (``LossScaler``'s
    ``good_steps``) and the skipped steps since the host last read them. Whole numbers and
    powers of two, exact in any float dtype a step computes in."""

    loss_scale: Any
    good_steps: Any
    skips: Any

    @classmethod
    def of(cls, vector: Any) -> Counters:
        """The named view of a counters vector."""
        return cls(*(vector[i] for i in range(len(cls._fields))))


class Deferred(NamedTuple):
    """The scalars of a deferred step: ``table`` (one :class:`StepScalars` row per number of
    skips since the host last read the counters: the count Adam's scalars are for differs by
    them) and ``counters`` (a :class:`Counters` vector: the previous step's output on the
    device, or the host's after a read)."""

    table: Any
    counters: Any

    def read(self, take) -> StepScalars:
        """(in a step) The step's :class:`StepScalars`: the table's row for the skips the
        device has counted (``take(table, skips)``: the family's indexing by a device
        number), with the device's loss scale."""
        c = Counters.of(self.counters)
        # (one row: no count to tell apart, and the skips may pass the table's length)
        row = self.table[0] if self.table.shape[0] == 1 else take(self.table, c.skips)
        return StepScalars.of(row)._replace(loss_scale=c.loss_scale)


def advance(xp, scaler: LossScaler | None, counters: Any, finite: Any) -> Any:
    """(in a deferred step) The :class:`Counters` after a step whose gradient was ``finite``
    or not, in the family's array module ``xp`` (``jax.numpy``, ``tensorflow``, ``torch``:
    their ``where`` and ``stack``): ``LossScaler.update`` on the device (halved on a skip, doubled
    after ``growth_interval`` clean steps: exact, powers of two) and one more skip counted."""
    c = Counters.of(counters)
    zero = c.skips * 0  # (of the counters' dtype in every family: a literal may not be)
    scale, good = c.loss_scale, c.good_steps
    if scaler is not None:
        grown = good + 1 >= scaler.growth_interval
        scale = xp.where(finite, xp.where(grown, scale * scaler.factor, scale),
                         scale / scaler.factor)
        good = xp.where(finite & ~grown, good + 1, zero)
    return xp.stack([scale, good, c.skips + xp.where(finite, zero, zero + 1)])


class Report(NamedTuple):
    """What a deferred step returns where a plain step returns its norm: the gradient's
    ``norm`` before clipping, the advanced ``counters``, whether the step was ``skipped``, and
    the loss ``scale`` it used."""

    norm: Any
    counters: Any
    skipped: Any
    scale: Any


class DeviceValue:
    """A scalar of a step that stays on the device until ``float()`` or ``bool()`` reads it
    (the Trainer does at its flush). A device-stacked value (one copy per device) and a global
    array read this process's first copy.

    Example:
        >>> v = DeviceValue(np.asarray([2.0, 2.0]))
        >>> float(v), bool(DeviceValue(np.asarray(False)))
        (2.0, False)
    """

    __slots__ = ("_value",)

    def __init__(self, value: Any):
        self._value = value

    def _read(self) -> Any:
        return np.asarray(local_copy(self._value)).reshape(-1)[0]

    def __float__(self) -> float:
        return float(self._read())

    def __bool__(self) -> bool:
        return bool(self._read())

    def __format__(self, spec: str) -> str:
        return format(float(self), spec)

    def __repr__(self) -> str:
        return f"DeviceValue({self._read()!r})"


def local_copy(value: Any) -> Any:
    """This process's first copy of ``value`` (a JAX array placed on several devices, possibly
    of several processes), or ``value`` itself."""
    data = getattr(value, "addressable_data", None)
    return value if data is None else data(0)


class UpdateRule:
    """One build's update settings and its host-side state.

    Args:
        optimizer: the build's optimizer: a spec (``toolkit.SGD``/``toolkit.Adam``: the count
            and scalars are kept here) or a native one (its framework counts).
        clip: ``clip_grad_norm`` (None: no clipping).
        skip: ``skip_nonfinite``: a step whose gradient norm is not finite changes nothing.
        scaler: the precision plugin's loss scaler (fp16-mixed), whose scale each step
            carries and which this rule halves or grows after the step (None: no scaling).
        defer: the family's step advances the :class:`Counters` itself (:meth:`step_scalars`
            returns :class:`Deferred` scalars when a step may skip, and :meth:`result` takes
            the step's :class:`Report`): no host read per step.

    Example:
        >>> rule = UpdateRule(Adam(lr=0.1), clip=1.0, skip=True)
        >>> rule.scalars(0.1).lr, rule.count
        (0.1, 1)
        >>> rule.result(0.5, float("nan")).skipped, rule.count
        (True, 0)
    """

    def __init__(self, optimizer: Any = None, clip: float | None = None, skip: bool = False,
                 scaler: LossScaler | None = None, defer: bool = False):
        self.spec = optimizer if isinstance(optimizer, SGD | Adam) else None
        self.scaler = scaler  # the precision plugin's (adapters/_precision.py), or None
        # skip: a step whose gradient is not finite changes nothing (asked for, or the
        # scaler's, which then lowers the scale: StepResult.overflow)
        self.clip, self.skip = clip, bool(skip) or self.scaler is not None
        self.deferred = bool(defer) and self.skip  # (nothing to defer unless a step can skip)
        self._count = 0  # optimizer steps of a spec optimizer (Adam's t), as of the last read
        self._window = 0  # deferred steps since the host last read the counters
        self._device: Any = None  # the latest step's counters (deferred), not yet read

    @property
    def needs_norm(self) -> bool:
        """Whether a step computes the gradient norm (to clip, or to know a skip): it
        reads every gradient once more, a cost worth paying only then (docs/equivalence.md)."""
        return self.clip is not None or self.skip

    @property
    def count(self) -> int:
        """The spec optimizer's steps so far, skipped ones not counted (deferred: read from
        the device's counters, which waits for the latest step)."""
        self.sync()
        return self._count

    @count.setter
    def count(self, value: int) -> None:
        self.sync()
        self._count = value

    def scalars(self, lr: float | None) -> StepScalars:
        """Counts one optimizer step of the spec and returns this step's :class:`StepScalars`
        (``lr`` None, for an optimizer that keeps its own rate: 0)."""
        self._count += 1
        return self._row(lr, self._count)

    def _row(self, lr: float | None, t: int) -> StepScalars:
        lr = 0.0 if lr is None else lr
        step_size, c2_sqrt = (adam_scalars(self.spec, t, lr)
                              if isinstance(self.spec, Adam) and t >= 1 else (0.0, 1.0))
        return StepScalars(lr, step_size, c2_sqrt,
                           1.0 if self.scaler is None else self.scaler.scale)

    def step_scalars(self, lr: float | None, dtype) -> Any:
        """This step's scalars as a compiled step takes them: :meth:`StepScalars.vector`, or
        (deferred) :class:`Deferred` scalars, whose table has a row per number of skips the
        device may have counted since the last read (one row unless the spec is Adam)."""
        if not self.deferred:
            return self.scalars(lr).vector(dtype)
        rows = self._rows
        if rows > 1:
            if self._window == rows:  # the table would run out: learn the skips
                self.sync()
            self._window += 1
        # with j skips so far this step is the spec's (count + window - j)-th
        table = [self._row(lr, self._count + self._window - j) for j in range(rows)]
        return Deferred(np.asarray(table, dtype), self._counters(dtype))

    @property
    def _rows(self) -> int:
        """The rows of a deferred step's table: Adam's scalars depend on the count of applied
        steps (one row per number of skips the host has not read yet), the others' do not."""
        return WINDOW if isinstance(self.spec, Adam) else 1

    def deferred_like(self, dtype) -> Any:
        """Zeros shaped as every step's :meth:`step_scalars` (for compiling ahead; counts
        nothing)."""
        if not self.deferred:
            return StepScalars.zeros(dtype)
        return Deferred(np.zeros((self._rows, len(StepScalars._fields)), dtype),
                        np.zeros(len(Counters._fields), dtype))

    def _counters(self, dtype) -> Any:
        if self._device is not None:
            return self._device
        scale, good = (1.0, 0) if self.scaler is None else (self.scaler.scale,
                                                            self.scaler.good_steps)
        return np.asarray(Counters(scale, good, 0), dtype)

    def sync(self) -> None:
        """(deferred) Reads the latest step's counters: the skips since the last read come off
        the spec's count, and the loss scaler takes the device's scale and clean steps."""
        if self._device is None:
            return
        c = Counters(*np.asarray(local_copy(self._device), np.float64))
        self._count += self._window - int(c.skips) if isinstance(self.spec, Adam) else 0
        if self.scaler is not None:
            self.scaler.scale, self.scaler.good_steps = float(c.loss_scale), int(c.good_steps)
        self._device, self._window = None, 0

    def result(self, loss: Any, norm: Any, skipped: bool | None = None,
               stacked: bool = False) -> StepResult:
        """The step's :class:`StepResult` from its ``loss`` and gradient ``norm`` (a framework
        scalar; ignored unless :attr:`needs_norm`). ``skipped`` None: read from the norm when
        skipping (one device-to-host copy); a skipped step's optimizer count is taken back.

        ``stacked``: ``norm`` holds one copy per device, as ``jax.pmap`` returns it. Deferred,
        ``norm`` is the step's :class:`Report`, whose counters the next step takes, and nothing
        is read: the result's norm, skip, scale and overflow are :class:`DeviceValue`\\ s."""
        if self.deferred:
            # (stacked: device 0's copy, without its leading axis)
            self._device = local_copy(norm.counters)[0] if stacked else norm.counters
            skipped = DeviceValue(norm.skipped)
            return StepResult(loss, DeviceValue(norm.norm), skipped,
                              None if self.scaler is None else DeviceValue(norm.scale),
                              overflow=skipped if self.scaler is not None else False)
        if not self.needs_norm:
            return StepResult(loss)
        if stacked:  # (the same on every device)
            norm = DeviceValue(norm)
        if skipped is None:
            skipped = self.skip and nonfinite(norm)
        if skipped and self.spec is not None:
            self._count -= 1
        if self.scaler is None:
            return StepResult(loss, norm, bool(skipped))
        used = self.scaler.scale
        self.scaler.update(finite=not skipped)
        return StepResult(loss, norm, bool(skipped), used, overflow=bool(skipped))

    # -------------------------------------------------------------------------- state
    def counters(self) -> dict[str, np.ndarray]:
        """``opt/count`` for an Adam spec and the loss scaler's state, as the checkpoint
        stores them."""
        self.sync()
        out = {"opt/count": np.asarray(self._count, np.int64)} \
            if isinstance(self.spec, Adam) else {}
        return out if self.scaler is None else {**out, **self.scaler.state()}

    def load(self, state: dict[str, np.ndarray]) -> None:
        """The count and the loss scaler's state from a checkpoint's state, where it has
        them."""
        self._device, self._window = None, 0
        if "opt/count" in state:
            self._count = int(state["opt/count"])
        if self.scaler is not None:
            self.scaler.load(state)
