"""Precision policies: which dtype the parameters, the arithmetic and the gradient collectives
use, and whether the loss is scaled. Framework-free: each framework family applies a policy in
its own way (torch autocast, Keras dtype policies, casts inside the jitted step in JAX).

    "32"          float32 everywhere (the default)
    "64"          float64 everywhere (the equivalence tests' precision)
    "bf16-mixed"  float32 master parameters and optimizer state; matmuls and activations in
                  bfloat16; gradients reduced in float32; the loss, softmax and normalisation
                  statistics in float32
    "fp16-mixed"  as bf16-mixed with float16, and dynamic loss scaling

A backend holds one policy (``adapters.get(name, precision=...)``, or the Trainer's
``precision=``) and hands it to the strategy of its layout; a strategy declares the policies it
runs, and any other is refused when the model is built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from toolkit.errors import ToolkitError

_BY_DTYPE = {"float32": "32", "float64": "64"}


@dataclasses.dataclass(frozen=True)
class Precision:
    """One precision policy.

    Attributes:
        name: one of :data:`PRECISIONS`.
        param_dtype: the master parameters' and the optimizer state's dtype.
        compute_dtype: the dtype of matmuls and activations. The gradient collectives carry
            ``param_dtype``: the gradients are those of the master parameters (FSDP2's
            ``reduce_dtype`` is a choice only where parameters are kept narrow).
        loss_scaling: whether the loss is scaled dynamically (fp16).
        init_scale, growth_interval: the dynamic loss scale's first value (a power of two,
            so that scaling and unscaling are exact) and the clean steps after which it
            doubles (:class:`LossScaler`; torch's ``GradScaler`` defaults); set them with
            :meth:`with_scaling`.

    Example:
        >>> p = Precision.of("bf16-mixed")
        >>> p.param_dtype, p.compute_dtype, p.loss_scaling
        ('float32', 'bfloat16', False)
        >>> Precision.of(None, dtype="float64").name
        '64'
        >>> Precision.of("bf16-mixed").mixed
        True
    """

    name: str
    param_dtype: str
    compute_dtype: str
    loss_scaling: bool = False
    init_scale: float = 2.0 ** 16
    growth_interval: int = 2000

    @property
    def mixed(self) -> bool:
        """Whether the arithmetic runs in a narrower dtype than the master parameters."""
        return self.compute_dtype != self.param_dtype

    def with_scaling(self, init_scale: float | None = None,
                     growth_interval: int | None = None) -> Precision:
        """This policy with the loss scaler's settings (None: as they are); a ToolkitError
        for a policy without loss scaling, a scale that is not a positive power of two, or an
        interval below 1.

        Example:
            >>> Precision.of("fp16-mixed").with_scaling(init_scale=1024).init_scale
            1024.0
        """
        if init_scale is None and growth_interval is None:
            return self
        if not self.loss_scaling:
            raise ToolkitError(f"precision {self.name!r} does not scale the loss, so "
                               "init_scale and growth_interval have nothing to set",
                               "use precision 'fp16-mixed', or drop them")
        if init_scale is not None:
            scale = float(init_scale)
            mantissa = np.frexp(scale)[0] if np.isfinite(scale) else 0.0
            if not (scale > 0 and mantissa == 0.5):
                lower = 2.0 ** np.floor(np.log2(scale)) if np.isfinite(scale) and scale > 0 \
                    else 2.0 ** 16
                raise ToolkitError(f"init_scale {init_scale!r} is not a positive power of two",
                                   f"use one, such as {lower:g} or {2 * lower:g}: the "
                                   "gradients are unscaled exactly only by a power of two")
        if growth_interval is not None and (isinstance(growth_interval, bool)
                                            or not isinstance(growth_interval, int | np.integer)
                                            or growth_interval < 1):
            raise ToolkitError(f"growth_interval {growth_interval!r} is not a whole number of "
                               "steps of at least 1", "use 2000 (torch's GradScaler default)")
        return dataclasses.replace(
            self, init_scale=self.init_scale if init_scale is None else float(init_scale),
            growth_interval=self.growth_interval if growth_interval is None
            else int(growth_interval))

    def scaler(self) -> LossScaler | None:
        """A fresh :class:`LossScaler` with this policy's settings; None without loss
        scaling."""
        if not self.loss_scaling:
            return None
        return LossScaler(init_scale=self.init_scale, growth_interval=self.growth_interval)

    def scaling_settings(self) -> dict[str, float | int] | None:
        """The loss scaler's settings as a run's settings record them; None without loss
        scaling."""
        if not self.loss_scaling:
            return None
        return {"init_scale": self.init_scale, "growth_interval": self.growth_interval}

    @classmethod
    def of(cls, precision: str | Precision | None = None, dtype: str | None = None) -> Precision:
        """The policy ``precision`` names; None: the plain policy of ``dtype`` (float32 when
        that is None too). A ToolkitError when the name is unknown, or when ``dtype``
        contradicts the policy's parameter dtype."""
        if isinstance(precision, Precision):
            chosen = precision
        elif precision is None:
            if dtype not in (None, *_BY_DTYPE):
                raise ToolkitError(f"unknown dtype {dtype!r}",
                                   "use one of: float32, float64 (the parameters' dtype); for "
                                   "bfloat16 or float16 arithmetic use precision='bf16-mixed' "
                                   "or 'fp16-mixed'")
            return cls.of(_BY_DTYPE[dtype or "float32"])
        else:
            chosen = _policy(str(precision))
        if dtype is not None and dtype != chosen.param_dtype:
            raise ToolkitError(
                f"precision {chosen.name!r} keeps its parameters in {chosen.param_dtype}, but "
                f"dtype {dtype!r} was asked for", f"drop dtype, or use precision "
                f"{_BY_DTYPE.get(dtype, '32')!r} for {dtype} parameters")
        return chosen


# The one table of policies: the Trainer, the CLIs and the strategies read their names here.
_POLICIES = {p.name: p for p in (
    Precision("32", "float32", "float32"),
    Precision("64", "float64", "float64"),
    Precision("bf16-mixed", "float32", "bfloat16"),
    Precision("fp16-mixed", "float32", "float16", loss_scaling=True))}
PRECISIONS = tuple(_POLICIES)


def _policy(name: str) -> Precision:
    if name not in _POLICIES:
        raise ToolkitError(f"unknown precision {name!r}", f"use one of: {', '.join(PRECISIONS)}")
    return _POLICIES[name]


def use_precision(adapter, precision: str | Precision | None) -> Precision:
    """The run's policy: ``precision`` set on ``adapter`` (which checks it against its
    parameters' dtype), or None: the adapter's own (an adapter of one's own without a
    ``precision`` attribute: the plain policy of its ``dtype_name``)."""
    held = getattr(adapter, "precision", None)
    plain = Precision.of(None, getattr(adapter, "dtype_name", None))
    if precision is None:
        return held if isinstance(held, Precision) else plain
    chosen = Precision.of(precision)
    if isinstance(held, Precision):
        adapter.precision = chosen
    elif chosen != plain:
        raise ToolkitError(f"the adapter {type(adapter).__name__} holds no precision policy, so "
                           f"it cannot run precision {chosen.name!r}",
                           f"drop precision (it runs {plain.name!r}), or give the adapter a "
                           "settable precision attribute (adapters._backend.Backend has one)")
    return chosen


def rounding(compute_dtype: str | None) -> Callable[[np.ndarray], np.ndarray]:
    """The numpy reference's rounding to ``compute_dtype`` (``bfloat16``, ``float16``): values
    rounded to it and held in float64 again (``ml_dtypes`` gives numpy a bfloat16); None, or a
    dtype the values already have (``float32``, ``float64``): nothing is rounded.

    Example:
        >>> r = rounding("bfloat16")
        >>> float(r(np.asarray([1 + 2 ** -9, 1 + 2 ** -7]))[0]), float(r(np.asarray([3.0]))[0])
        (1.0, 3.0)
    """
    if compute_dtype in (None, "float32", "float64"):
        return lambda a: a
    if compute_dtype == "float16":
        target = np.float16
    elif compute_dtype == "bfloat16":
        try:
            import ml_dtypes
        except ImportError as err:
            raise ToolkitError("the bfloat16 reference needs the ml_dtypes package",
                               "pip install ml_dtypes (it comes with JAX and TensorFlow)") from err
        target = ml_dtypes.bfloat16
    else:
        raise ToolkitError(f"no reference rounding for {compute_dtype!r}",
                           "use bfloat16 or float16")

    def round_to(a: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):  # (beyond float16's range: inf, as on a device)
            return np.asarray(a).astype(np.float32).astype(target).astype(np.float64)

    return round_to


class LossScaler:
    """Dynamic loss scaling for float16 (torch's ``GradScaler`` rule): the loss is multiplied by
    :attr:`scale` before the backward pass and the gradients divided by it after; a step whose
    gradient is not finite is skipped and the scale halved, and after ``growth_interval`` clean
    steps in a row the scale doubles. Powers of two, so scaling and unscaling are exact.

    Framework-free: the strategies' update path and the numpy reference use the same one, and
    its state is checkpointed (:meth:`state`), so a resumed run scales as an uninterrupted one.

    Example:
        >>> s = LossScaler(init_scale=8.0, growth_interval=2)
        >>> s.update(finite=True); s.update(finite=True); s.scale
        16.0
        >>> s.update(finite=False); s.scale, s.good_steps
        (8.0, 0)
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_interval: int = 2000,
                 factor: float = 2.0):
        self.scale, self.growth_interval, self.factor = float(init_scale), growth_interval, factor
        self.good_steps = 0  # clean steps since the last change of scale

    def update(self, finite: bool) -> None:
        """After a step: halve on a non-finite gradient, double after enough clean steps."""
        if not finite:
            self.scale, self.good_steps = self.scale / self.factor, 0
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale, self.good_steps = self.scale * self.factor, 0

    def state(self) -> dict[str, np.ndarray]:
        """``scaler/scale`` and ``scaler/good_steps``, as the checkpoint names them."""
        return {"scaler/scale": np.asarray(self.scale, np.float64),
                "scaler/good_steps": np.asarray(self.good_steps, np.int64)}

    def load(self, state: dict[str, np.ndarray]) -> None:
        """The scale from a checkpoint's state, when it has one."""
        if "scaler/scale" in state:
            self.scale = float(state["scaler/scale"])
            self.good_steps = int(state["scaler/good_steps"])
