"""Data parallelism for ``horovod-torch``: every rank holds the whole model and optimizer.

One step is forward, backward, Horovod's gradient allreduce (averaged; hooks fire as each
gradient is ready and ``DistributedOptimizer.synchronize`` waits for them), then the family's
update path (``update.py``: norm, finite check, clip) and the optimizer's step.

A native ``nn.Module`` brings all of its state: parameters under ``params/<torch name>``,
registered buffers (BatchNorm running statistics and counters) under ``buffers/<torch name>``.
Buffers are broadcast from rank 0 at the start, and again before every evaluation and
checkpoint (``sync_state``), unless ``sync_batchnorm`` keeps them equal on every rank by
computing BatchNorm statistics over the global batch (Horovod's ``SyncBatchNorm``). Dropout and
other torch randomness is seeded per step from (seed, step, rank), so a resumed run draws
what an uninterrupted one would have.

``sharded.py`` runs the same step with flat shards in the optimizer's place: it subclasses this
strategy and replaces the hooks marked below (how the optimizer is made, zeroed, applied; what
the forward runs inside; how the state is read and written).
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np

from adapters._backend import StrategyBase
from adapters._common import check_recompute, step_seed
from adapters._update import Deferred, UpdateRule
from adapters.horovod_torch.models.spec import build_spec_model, from_host, same, to_host
from adapters.horovod_torch.models.sync_bn import convert_sync_batchnorm
from adapters.horovod_torch.ops import (
    NEUTRAL_SLOTS,
    LossSum,
    TorchOps,
    count_like,
    kept_buffers,
    make_optimizer,
    set_lr,
    zero_slots,
)
from adapters.horovod_torch.precision import TorchPrecision
from adapters.horovod_torch.scheduler import load_scheduler_state, scheduler_state, split_scheduler
from adapters.horovod_torch.torch_optim import built_over
from adapters.horovod_torch.update import step_scalars, sum_of_squares, takes_found_inf, update
from toolkit import ToolkitError
from toolkit.contract import StepResult
from toolkit.models.specs import ModelSpec
from toolkit.precision import PRECISIONS


class TorchDataParallel(StrategyBase):
    """``toolkit.DataParallel`` for ``horovod-torch`` (see :class:`toolkit.Adapter`)."""

    clips = True  # build takes clip_grad_norm; train_step's StepResult has grad_norm
    skips = True  # build takes skip_nonfinite; train_step's StepResult says skipped
    counts = False  # whether the UpdateRule keeps a spec optimizer's count (else torch.optim)
    compresses = True  # the runtime's compression goes to DistributedOptimizer
    recomputes = True  # activation_checkpointing: the spec model's blocks (models/spec.py)
    # mixed: torch autocast (ops.TorchOps.computing); fp16 with the update path's loss scaler
    precisions = PRECISIONS
    plugin = TorchPrecision  # (adapters/_precision.py)

    scheduler = None  # a torch LR scheduler given with a native optimizer, after build
    defers = True  # the update's counters on the device where the optimizer allows (build)

    def __init__(self, runtime, layout, precision: Any = None):
        super().__init__(runtime, layout, precision)
        self.torch, self.hvd, self.dtype = runtime.torch, runtime.hvd, runtime.dtype
        self.dev = runtime.dev  # the rank's GPU, or the CPU

    # -------------------------------------------------------------------------- build
    def build(self, model: Any, optimizer: Any, loss: Any, *, seed: int = 0,
              accumulation_steps: int = 1, sync_batchnorm: bool = False,
              metrics: Any = None, clip_grad_norm: float | None = None,
              skip_nonfinite: bool = False, activation_checkpointing: bool | None = None) -> None:
        torch = self.torch
        self.ops = TorchOps(self.runtime, loss, metrics)
        self.accumulation_steps, self.seed = accumulation_steps, seed
        self.native = not isinstance(model, ModelSpec)
        check_recompute("horovod-torch", model, activation_checkpointing)
        if not self.native:
            self.net, self.params = build_spec_model(torch, model, activation_checkpointing)
            self.net.to(device=self.dev, dtype=self.dtype)
        elif isinstance(model, torch.nn.Module):
            self.net = model.to(device=self.dev, dtype=self.dtype)
            if sync_batchnorm:
                convert_sync_batchnorm(torch, self.hvd, self.net)
            self.params = [(n, p, same, same) for n, p in self.net.named_parameters()]
        else:
            raise ToolkitError(f"horovod-torch cannot build a model from {type(model).__name__}",
                               "pass a toolkit.MLP/CNN/GPT spec or a torch.nn.Module")
        self.sync_batchnorm = sync_batchnorm
        self.buffers = [(n, b) for n, b in self.net.named_buffers() if b is not None]
        self.steps = 0  # optimizer steps taken: the randomness of the next one derives from it
        # (a function of the parameters builds the optimizer over the model's)
        optimizer = built_over(torch, optimizer, [p for _, p, _, _ in self.params])
        optimizer, self.scheduler = split_scheduler(torch, optimizer)
        self._build_optimizer(model, optimizer, seed)
        # the skip stays on the device where the optimizer takes it as a flag (torch's fused
        # kernels: the spec optimizers on a GPU) and no scheduler must count the updates
        defer = self.defers and self.scheduler is None and self._skips_on_device()
        self.rule = UpdateRule(optimizer if self.counts else None, clip_grad_norm, skip_nonfinite,
                               self.precision.scaler, defer=defer)

    def _build_optimizer(self, model: Any, optimizer: Any, seed: int) -> None:
        """(hook) Rank 0's initial model, and a Horovod ``DistributedOptimizer`` over it."""
        torch, hvd = self.torch, self.hvd
        if not self.native:
            self._load_params(model.init(seed, self.runtime.dtype_name))
        # DistributedOptimizer builds a new optimizer over the same param groups (with empty
        # state), so slots are filled in after wrapping, before the state is broadcast.
        params = list(self.net.parameters())
        # the state a torch.optim optimizer makes when built (Adagrad's initial sums), which
        # DistributedOptimizer's new optimizer of the same class builds from its defaults
        made = {p: dict(s) for p, s in getattr(optimizer, "state", {}).items()}
        self.opt = hvd.DistributedOptimizer(
            make_optimizer(torch, optimizer, params), named_parameters=self.net.named_parameters(),
            op=hvd.Average, backward_passes_per_step=self.accumulation_steps,
            compression=self.runtime.compressor())
        zero_slots(torch, self.opt, params, optimizer)
        hvd.broadcast_parameters(self.net.state_dict(), root_rank=0)  # parameters and buffers
        fresh = [p.detach().clone() for p in params] if not self.opt.state else []
        hvd.broadcast_optimizer_state(self.opt, root_rank=0)
        if fresh:  # Horovod made the state with a zero-gradient step (weight decay, count): undo
            with torch.no_grad():
                for p, before in zip(params, fresh, strict=True):
                    p.copy_(before)
                for slots in self.opt.state.values():
                    for value in slots.values():
                        if torch.is_tensor(value):
                            value.zero_()
        for p, slots in made.items():  # (made before the model moved to its device and dtype)
            self.opt.state[p].update({k: v.to(p) if torch.is_tensor(v) and v.shape == p.shape
                                      else v for k, v in slots.items()})

    # -------------------------------------------------------------------------- hooks
    def _forwarding(self):
        """(hook) What each forward pass runs inside."""
        return contextlib.nullcontext()

    def _zero_grad(self) -> None:
        """(hook)"""
        self.opt.zero_grad()

    def _apply(self, lr: float | None, scalars: Any, kept: list) -> Any:
        """(hook) The update with this step's learning rate and ``scalars`` (:meth:`_scalars`),
        through ``update.update``: the averaged gradients (synchronized first, Horovod's
        documented way to clip), their norm, clip and finite check, then the optimizer's step;
        ``kept``: ``(buffer, its value before the step)`` pairs, which a skipped step puts
        back (``ops.kept_buffers``). Returns
        ``update``'s norm (or ``Report``)."""
        set_lr(self.opt, lr)
        self.opt.synchronize()  # (what step() would do first: the same update)
        grads = [p.grad for p in self.net.parameters() if p.grad is not None]
        return update(self.torch, self.rule, grads, lambda g: sum_of_squares(self.torch, g),
                      self._step_optimizer, kept, scalars)[1]

    def _skips_on_device(self) -> bool:
        """(hook) Whether the update can apply nothing on a device flag."""
        return takes_found_inf(self.opt)

    def _scalars(self, lr: float | None) -> Any:
        """Counts the step and returns its scalars (``UpdateRule.step_scalars``): host
        ``StepScalars``, or deferred ones as tensors on the rank's device."""
        if not self.rule.deferred:  # (host numbers, as the torch ops take them)
            return self.rule.scalars(lr)
        return Deferred(*(self.torch.as_tensor(a, device=self.dev)
                          for a in self.rule.step_scalars(lr, self.runtime.dtype_name)))

    def _step_optimizer(self, found_inf: Any) -> None:
        if found_inf is not None:  # (torch's fused kernels skip where it is set)
            self.opt.found_inf, self.opt.grad_scale = found_inf, None
        with self.opt.skip_synchronize():
            self.opt.step()
        self._count_update()

    def _count_update(self) -> None:
        """A native scheduler counts an applied update (as Keras' and optax's own schedules
        do; a deferred build has no scheduler)."""
        if self.scheduler is not None:
            self.scheduler.step()

    # -------------------------------------------------------------------------- steps
    def train_step(self, x: np.ndarray, y: np.ndarray, lr: float | None) -> StepResult:
        if self.native:
            self.torch.manual_seed(step_seed(self.seed, self.steps, self.env.rank))
        self.net.train()
        xt, yt = self.ops.tensors(x, y)
        k = self.accumulation_steps
        kept = kept_buffers(self.buffers, self.rule.skip)
        scalars = self._scalars(lr)
        scale = self.precision.step_scale(step_scalars(self.torch, scalars))
        self._zero_grad()
        losses = []
        for xc, yc in zip(xt.chunk(k), yt.chunk(k), strict=True):
            with self._forwarding(), self.precision.forward_context():
                loss = self.ops.mean_loss(self.net(xc), yc)
            if k > 1:
                loss = loss / k
            self.precision.scale_loss(loss, scale).backward()  # (fp16: the update unscales)
            losses.append(loss.detach())
        norm = self._apply(lr, scalars, kept)
        self.steps += 1
        # the loss read when the Trainer flushes its interval, not here: the host queues the
        # next step
        return self.rule.result(LossSum(self.torch, losses), norm)

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
        self.net.eval()
        xt, yt = self.ops.tensors(x, y)
        with self.torch.no_grad(), self._forwarding(), self.precision.forward_context():
            return self.ops.sums(self.net(xt), yt)

    def sync_state(self) -> None:
        """Rank 0's buffers (BatchNorm statistics) become every rank's."""
        if self.env.world_size > 1 and self.buffers and not self.sync_batchnorm:
            self.hvd.broadcast_parameters(self.buffers, root_rank=0)

    # -------------------------------------------------------------------------- state
    def _load_params(self, params: dict[str, np.ndarray]) -> None:
        self._load({f"params/{k}": v for k, v in params.items()}, params_only=True)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients and optimizer state: every
        parameter, a gradient of each parameter's size, every optimizer slot."""
        params = sum(p.nbytes for _, p, _, _ in self.params)
        slots = sum(v.nbytes for state in self.opt.state.values() for v in state.values()
                    if self.torch.is_tensor(v))
        return {"params": params, "grads": params, "optimizer": slots}

    def _model_state(self) -> dict[str, np.ndarray]:
        """Buffers, the update rule's counters, and the step the randomness of native models
        derives from."""
        out = {f"buffers/{name}": to_host(b, same) for name, b in self.buffers}
        out.update(self.rule.counters())  # (the loss scaler's; a sharded build's count)
        if self.native:
            out["rng/step"] = np.asarray(self.steps, np.int64)
        return out

    def state_dict(self) -> dict[str, np.ndarray]:
        out, step = {}, None
        for name, p, _, from_torch in self.params:
            out[f"params/{name}"] = to_host(p, from_torch)
            for key, value in self.opt.state.get(p, {}).items():
                if key == "step":
                    step = int(value)
                else:
                    out[f"opt/{NEUTRAL_SLOTS.get(key, key)}/{name}"] = to_host(value, from_torch)
        if step is not None:
            out["opt/count"] = np.asarray(step, np.int64)
        if self.scheduler is not None:
            out.update(scheduler_state(self.scheduler, self.opt))
        return {**out, **self._model_state()}

    def _tensor(self, a, to_torch, dtype=None):
        return from_host(self.torch, a, to_torch, dtype or self.dtype, self.dev)

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        self._load(state)

    def _load(self, state: dict[str, np.ndarray], params_only: bool = False) -> None:
        torch = self.torch
        with torch.no_grad():
            for name, p, to_torch, _ in self.params:
                p.copy_(self._tensor(state[f"params/{name}"], to_torch))
                if params_only:
                    continue
                slots = self.opt.state.get(p, {})
                for key in list(slots):
                    if key == "step":
                        slots["step"] = count_like(torch, slots["step"], state["opt/count"])
                    else:
                        slots[key] = self._tensor(
                            state[f"opt/{NEUTRAL_SLOTS.get(key, key)}/{name}"], to_torch)
            if params_only:
                return
            if self.scheduler is not None:
                load_scheduler_state(self.scheduler, self.opt, state)
            self._load_model_state(state)

    def _load_model_state(self, state: dict[str, np.ndarray]) -> None:
        self.rule.load(state)
        with self.torch.no_grad():
            for name, b in self.buffers:
                b.copy_(self._tensor(state[f"buffers/{name}"], same, b.dtype))
        if self.native:
            self.steps = int(state["rng/step"])
