"""A backend = a runtime x a strategy per layout; the one place a layout picks its code.

The adapter the Trainer sees (``toolkit.Adapter``) is a :class:`Backend`. It owns two objects:

- a :class:`Runtime`: the framework's communicator (start it for an environment and a
  layout, host-side allreduce / broadcast / barrier, shut it down), one per framework family;
- a :class:`Strategy`: how the model, its gradients and its optimizer state are laid out and
  stepped under one layout (data parallel, sharded, pipeline), one per framework x layout.

A backend declares the layouts it runs as data, ``strategies = {layout kind: "module:Class"}``;
:meth:`Backend.setup` looks the layout's kind up there (the only layout dispatch) and makes
the strategy over the started runtime. Modules are named as text and imported when chosen, so
``adapters.get(name)`` imports no framework.

    backend (facade) --setup(env, layout)--> runtime.setup(env, layout)
                                          -> strategies[layout.kind](runtime, layout)
    build, train_step, evaluate, sync_state, state_dict, load_state_dict,
    sharded_state, memory_bytes, position                        -> the strategy
    allreduce, broadcast, barrier, shutdown, devices             -> the runtime
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

import numpy as np

from adapters._precision import PrecisionPlugin
from toolkit import ToolkitError
from toolkit.contract import StepResult
from toolkit.launch.env import LaunchEnv
from toolkit.parallel.layouts import DataParallel, ParallelDims
from toolkit.precision import Precision

PLAIN = ("32", "64")  # the policies without a narrower compute dtype: every strategy runs them


class Runtime(Protocol):
    """A framework's communicator. ``setup`` once, then collectives, then ``shutdown``."""

    env: LaunchEnv
    dtype_name: str

    def setup(self, env: LaunchEnv, layout: Any, device: str = "auto") -> None:
        """Starts the framework for ``env`` on the rank's ``device`` (``auto``, ``cpu``,
        ``gpu``: ``toolkit.launch.devices.choose_device``); ``layout`` may add to the start (Horovod
        registers a pipeline's process sets then). Checks rank and size against ``env``."""

    def allreduce(self, values: np.ndarray, op: str = "mean") -> np.ndarray: ...
    def broadcast(self, values: np.ndarray, root: int = 0) -> np.ndarray: ...
    def barrier(self) -> None: ...
    def shutdown(self) -> None: ...
    def local_device_count(self) -> int: ...
    def device_names(self) -> list[str]: ...


class Strategy(Protocol):
    """One layout of one framework, made as ``Strategy(runtime, layout)`` after the runtime
    started. The same signature in every backend; see ``toolkit.Adapter`` for each method."""

    def build(self, model: Any, optimizer: Any, loss: Any, *, seed: int = 0,
              accumulation_steps: int = 1, sync_batchnorm: bool = False,
              metrics: dict[str, Any] | None = None) -> None: ...
    def train_step(self, x: Any, y: Any, lr: float | None) -> StepResult: ...
    def evaluate(self, x: np.ndarray, y: np.ndarray) -> dict[str, float]: ...
    def sync_state(self) -> None: ...
    def state_dict(self) -> dict[str, np.ndarray]: ...
    def load_state_dict(self, state: dict[str, np.ndarray]) -> None: ...
    def sharded_state(self) -> tuple[dict[str, np.ndarray], dict[str, tuple]]: ...
    def memory_bytes(self) -> dict[str, int]: ...

    @property
    def position(self) -> tuple[int, int]:
        """This rank's ``(stage, replica)`` (``(0, rank)`` without stages)."""


def load(path: str, package: str | None = None) -> Any:
    """The object ``"module:Name"`` names (a module relative to ``package`` when it starts
    with a dot), imported now."""
    module, name = path.split(":")
    return getattr(importlib.import_module(module, package), name)


class Backend:
    """The adapter of one backend (``toolkit.Adapter``): a runtime and the strategy of the
    layout given to :meth:`setup`. A subclass names them::

        class HorovodTorchAdapter(Backend):
            name = "horovod-torch"
            runtime_class = "adapters.horovod_torch.runtime:TorchRuntime"
            strategies = {"data_parallel": "adapters.horovod_torch.data_parallel:...", ...}
    """

    name = "backend"
    runtime_class = ""  # "module:Class" of its Runtime, made with (dtype, **options) at once
    strategies: dict[str, str] = {}  # layout kind -> "module:Class" of its Strategy

    def __init__(self, dtype: str | None = None, precision: str | None = None,
                 **options: Any):
        self._precision = Precision.of(precision, dtype)
        self.dtype_name = self._precision.param_dtype
        # (checks the options)
        self.runtime: Any = load(self.runtime_class)(self.dtype_name, **options)
        self.strategy: Any = None
        self.layout: Any = None

    @property
    def precision(self) -> Precision:
        """The precision policy (``toolkit.precision``) this backend hands to its strategies."""
        return self._precision

    @precision.setter
    def precision(self, precision: str | Precision) -> None:
        """Another policy with the same parameter dtype (the runtime's), before ``build``."""
        chosen = Precision.of(precision)
        if chosen.param_dtype != self.dtype_name:
            raise ToolkitError(
                f"precision {chosen.name!r} keeps its parameters in {chosen.param_dtype}, but "
                f"this {self.name} backend was made for {self.dtype_name} parameters",
                f"make it with adapters.get({self.name!r}, precision={chosen.name!r})")
        self._precision = chosen  # (the strategy takes it at its build)

    @property
    def layouts(self) -> tuple[str, ...]:
        """The layout kinds this backend runs (``toolkit.Adapter.layouts``)."""
        return tuple(self.strategies)

    @property
    def env(self) -> LaunchEnv:
        return self.runtime.env

    def setup(self, env: LaunchEnv, layout: Any = None, device: str = "auto") -> None:
        """Starts the runtime for ``env``, ``layout`` (None: data parallel) and ``device``,
        and makes the layout's strategy. Called again with another layout, the runtime stays
        and the strategy is made anew."""
        layout = DataParallel() if layout is None else layout
        kind = getattr(layout, "kind", None)
        if kind not in self.strategies:
            raise ToolkitError(f"backend {self.name!r} cannot run layout {layout!r}",
                               f"{self.name} runs: {', '.join(self.strategies)}")
        strategy_class = load(self.strategies[kind])
        if isinstance(layout, ParallelDims):  # (a composition: the dimensions it runs)
            missing = [d for d in layout.active  # (beside the kind's own dimension)
                       if d not in strategy_class.composes and d != kind]
            if missing:
                raise ToolkitError(
                    f"backend {self.name!r} does not compose {' and '.join(missing)} in "
                    f"{layout.name}", "docs/layouts/composing.md lists what each backend "
                    "composes; drop the dimension or choose a backend that composes it")
        strategy_class.check_layout(layout)  # refused before any communicator starts
        self.runtime.setup(env, layout, device)
        self.strategy = strategy_class(self.runtime, layout, self.precision)
        self.layout = layout

    def _started(self) -> Any:
        if self.strategy is None:
            raise ToolkitError(f"{self.name}: setup(env, layout) has not been called",
                               "call adapter.setup(toolkit.current_env()) first (the Trainer "
                               "does)")
        return self.strategy

    # ------------------------------------------------------------------ the strategy's
    def build(self, model: Any, optimizer: Any, loss: Any, **options: Any) -> None:
        strategy = self._started()
        if strategy.precision.policy != self.precision:  # (set since setup: a fresh strategy)
            strategy = self.strategy = type(strategy)(self.runtime, self.layout, self.precision)
        if options.get("clip_grad_norm") is not None and not strategy.clips:
            raise ToolkitError(
                f"{self.name} does not clip gradients under {self.layout.name} "
                f"(clip_grad_norm={options['clip_grad_norm']})",
                "drop clip_grad_norm, or give this strategy a clip_grad_norm build option "
                "(docs/architecture.md)")
        if options.get("skip_nonfinite") and not strategy.skips:
            raise ToolkitError(
                f"{self.name} cannot skip a step under {self.layout.name} "
                "(on_nonfinite='skip')",
                "use on_nonfinite='stop', or give this strategy a skip_nonfinite build option "
                "(docs/architecture.md)")
        if options.get("activation_checkpointing") and not strategy.recomputes:
            raise ToolkitError(
                f"{self.name} cannot recompute activations under {self.layout.name} "
                "(activation_checkpointing=True)", "drop activation_checkpointing for this "
                "layout (docs/memory.md says which recompute)")
        compression = getattr(self.runtime, "compression", "none")
        if compression != "none" and not strategy.compresses:
            raise ToolkitError(
                f"{self.name} does not compress gradients under {self.layout.name} "
                f"(compression={compression!r})", "the data-parallel layout compresses its "
                "gradient allreduce; drop compression for this layout")
        runs = strategy.precisions
        if self.precision.name not in runs:
            raise ToolkitError(
                f"{self.name} does not run precision {self.precision.name!r} under "
                f"{self.layout.name}", f"this strategy runs: {', '.join(runs)}")
        strategy.build(model, optimizer, loss, **options)

    def train_step(self, x: Any, y: Any, lr: float | None) -> StepResult:
        return self.strategy.train_step(x, y, lr)

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
        return self.strategy.evaluate(x, y)

    def sync_state(self) -> None:
        self.strategy.sync_state()

    def state_dict(self) -> dict[str, np.ndarray]:
        return self.strategy.state_dict()

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        self.strategy.load_state_dict(state)

    def sharded_state(self) -> tuple[dict[str, np.ndarray], dict[str, tuple]]:
        return self.strategy.sharded_state()

    def memory_bytes(self) -> dict[str, int]:
        return self.strategy.memory_bytes()

    def pipeline_position(self) -> tuple[int, int]:
        """This rank's ``(stage, replica)`` (``(0, rank)`` without a pipeline layout)."""
        return self.strategy.position

    # ------------------------------------------------------------------ the runtime's
    def allreduce(self, values: np.ndarray, op: str = "mean") -> np.ndarray:
        return self.runtime.allreduce(values, op)

    def broadcast(self, values: np.ndarray, root: int = 0) -> np.ndarray:
        return self.runtime.broadcast(values, root)

    def barrier(self) -> None:
        self.runtime.barrier()

    def shutdown(self) -> None:
        self.runtime.shutdown()

    def local_device_count(self) -> int:
        return self.runtime.local_device_count()

    def device_names(self) -> list[str]:
        return self.runtime.device_names()


class StrategyBase:
    """What every strategy starts from: its runtime and layout, no layout check, and the
    position of a rank without stages."""

    clips = False  # whether build takes clip_grad_norm (its StepResult then has grad_norm)
    skips = False  # whether build takes skip_nonfinite (its StepResult then says skipped)
    precisions = PLAIN  # the precision policies it runs (toolkit.precision)
    compresses = False  # whether it takes a Horovod runtime's gradient compression
    recomputes = False  # whether build takes activation_checkpointing
    composes: tuple[str, ...] = ()  # the dimensions it runs together (ParallelDims.active)

    plugin: type = PrecisionPlugin  # its family's precision plugin (adapters/_precision.py)

    def __init__(self, runtime: Any, layout: Any, precision: Any = None):
        """``precision``: the backend's policy (None: the plain one of the runtime's dtype),
        or a plugin to share (a pipeline executor's with the strategy it computes with)."""
        self.runtime, self.layout, self.env = runtime, layout, runtime.env
        if not isinstance(precision, PrecisionPlugin):
            precision = self.plugin(precision or Precision.of(None, runtime.dtype_name), runtime)
        self.precision = precision

    @staticmethod
    def check_layout(layout: Any) -> None:
        """A ToolkitError for a layout of this kind that this strategy refuses."""

    @property
    def position(self) -> tuple[int, int]:
        return 0, self.env.rank

    @property
    def data_split(self) -> tuple[int, int]:
        """``(ranks, devices per rank)`` each global batch's gradient is computed over, each
        part in its own (rounded) arithmetic: what a mixed-precision reference must split."""
        return self.env.world_size, self.runtime.local_device_count()

    part_weight = 1.0  # what each part's mean loss is multiplied by before its backward

    def sharded_state(self) -> tuple[dict[str, np.ndarray], dict[str, tuple]]:
        raise ToolkitError(f"sharded_state() needs a sharded layout; this run is "
                           f"{self.layout.name}", "use state_dict(), or train with "
                           "layout=toolkit.Sharded(stage=...)")
