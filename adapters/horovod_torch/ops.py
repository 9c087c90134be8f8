"""The torch arithmetic every ``horovod-torch`` layout shares: host arrays as tensors, the loss
per sample and its batch mean, evaluation sums, and the optimizers built from the toolkit's
specs (with their slots filled from step 0)."""

from __future__ import annotations

from typing import Any

import numpy as np

from adapters._common import check_per_sample, loss_name, model_outputs
from toolkit import SGD, Adam, ToolkitError
from toolkit.errors import describe

# Neutral optimizer-state names (the checkpoint format's) <-> torch.optim state keys.
TORCH_SLOTS = {"momentum": "momentum_buffer", "mu": "exp_avg", "nu": "exp_avg_sq"}
NEUTRAL_SLOTS = {v: k for k, v in TORCH_SLOTS.items()}


class TorchOps:
    """The loss (``cross_entropy``, ``mse`` or a callable) and metrics of one build, in the
    runtime's ``dtype``."""

    def __init__(self, runtime, loss: Any, metrics: dict[str, Any] | None = None):
        self.torch, self.dtype, self.arrive = runtime.torch, runtime.dtype, runtime.arrive
        self.loss_name, self.loss_fn = loss_name(loss), loss
        self.metrics = dict(metrics or {})

    def tensors(self, x: np.ndarray, y: np.ndarray):
        """``(x, y)`` (host arrays, or a batch the runtime staged on the GPU) as tensors on the
        rank's device: floats in the compute dtype, class labels as ``long``."""
        xt = self.arrive(x)
        if xt.is_floating_point():
            xt = xt.to(self.dtype)
        yt = self.arrive(y)
        if self.loss_name == "cross_entropy":
            yt = yt.to(self.torch.long)
        if yt.is_floating_point():
            yt = yt.to(self.dtype)
        return xt, yt

    def per_sample(self, out, y):
        """One loss per sample: a token-level loss is averaged over the sample's tokens (in
        the parameters' dtype, whatever the outputs' under mixed precision)."""
        f, out = self.torch.nn.functional, model_outputs(out).to(self.dtype)
        if self.loss_name == "custom":
            losses = self.loss_fn(out, y)
            check_per_sample(losses.shape, len(out))
            return losses
        if self.loss_name == "cross_entropy":
            tokens = f.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1),
                                     reduction="none")
            return tokens.reshape(len(out), -1).mean(dim=1)
        return ((out - y.reshape(out.shape)) ** 2).reshape(len(out), -1).mean(dim=1)

    def mean_loss(self, out, y):
        """The batch's mean loss. Every sample has the same number of positions, so for the
        cross-entropy it is torch's own mean over all of them, one fused op (per-sample means
        and their mean made the step 1-1.5% slower on a 9 ms MLP step, measured)."""
        out = model_outputs(out)
        if self.loss_name == "cross_entropy":  # (the sum over numel: every position counts)
            out = out.to(self.dtype)  # (the loss in float32 under mixed precision)
            return self.torch.nn.functional.cross_entropy(
                out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="sum") / y.numel()
        return self.per_sample(out, y).mean()

    def sums(self, out, yt) -> dict[str, float]:
        """``loss_sum``, ``count``, ``correct`` (classification) and each metric's sum over
        the outputs ``out`` of a batch (which may be empty)."""
        out = model_outputs(out)
        torch, n = self.torch, len(out)
        result = {"loss_sum": float(self.per_sample(out, yt).sum()) if n else 0.0,
                  "count": float(n)}
        if self.loss_name == "cross_entropy":
            hits = (out.argmax(dim=-1) == yt).to(torch.float64).reshape(n, -1)
            result["correct"] = float(hits.mean(dim=1).sum()) if n else 0.0
        for name, fn in self.metrics.items():
            if not n:
                result[name] = 0.0
                continue
            values = fn(out, yt)
            check_per_sample(values.shape, n, what=f"metric {name!r}")
            result[name] = float(values.sum())
        return result


def make_optimizer(torch, spec: Any, params: list, backend: str = "horovod-torch"):
    """A ``torch.optim`` optimizer over ``params`` from a toolkit spec (with explicit zero
    slots), or the user's own optimizer after checking it holds exactly those parameters.
    On a GPU the spec's optimizer is torch's fused kernel (one launch for all parameters, what
    a hand-written GPU loop uses); on the CPU torch's default implementation."""
    if isinstance(spec, SGD | Adam):
        fused = {"fused": True} if params and params[0].is_cuda else {}
        if isinstance(spec, SGD):
            opt = torch.optim.SGD(params, lr=0.0, momentum=spec.momentum,
                                  nesterov=spec.nesterov, weight_decay=spec.weight_decay,
                                  **fused)
        else:
            cls = torch.optim.AdamW if spec.decoupled else torch.optim.Adam
            opt = cls(params, lr=0.0, betas=(spec.b1, spec.b2), eps=spec.eps,
                      weight_decay=spec.weight_decay, **fused)
        return opt
    if isinstance(spec, torch.optim.Optimizer):
        mine = {id(p) for p in params}
        foreign = [i for i, g in enumerate(spec.param_groups)
                   for p in g["params"] if id(p) not in mine]
        if foreign:
            raise ToolkitError(
                f"the torch optimizer holds {len(foreign)} tensors that are not the model's "
                f"parameters (param group {foreign[0]})",
                "build the optimizer over model.parameters() of the model you pass (after "
                "moving it to its device and dtype)")
        return spec
    raise ToolkitError(f"{backend} cannot build an optimizer from {describe(spec)}",
                       "pass toolkit.SGD(...)/toolkit.Adam(...) or a torch.optim "
                       "optimizer over the model's parameters")


def zero_slots(torch, opt, params: list, spec: Any) -> None:
    """Explicit zero optimizer state, so that the state names every slot from step 0.

    Zero buffers give exactly the update of torch's lazy initialisation, and they keep
    Horovod's broadcast_optimizer_state from running a dummy step (which would advance
    Adam's step count). The step count lives where torch keeps it: on the CPU, or beside
    the parameter (float32) for the fused kernel.
    """
    for p in params:
        if isinstance(spec, SGD) and spec.momentum:
            opt.state[p]["momentum_buffer"] = torch.zeros_like(p)
        elif isinstance(spec, Adam):
            fused = opt.param_groups[0].get("fused")
            step = (torch.zeros((), dtype=torch.float32, device=p.device) if fused
                    else torch.tensor(0.0))
            opt.state[p].update(step=step, exp_avg=torch.zeros_like(p),
                                exp_avg_sq=torch.zeros_like(p))


def count_like(torch, old, value) -> Any:
    """The step count ``value`` as the optimizer keeps ``old``: a tensor of its dtype on its
    device, or a number of its type (e.g. ``SparseAdam``'s int)."""
    if torch.is_tensor(old):
        return torch.tensor(float(value), dtype=old.dtype, device=old.device)
    return type(old)(value)


class LossSum:
    """A step's mean loss as the sum of its micro-batches' losses (tensors on the device),
    read by ``float()`` only when the Trainer averages losses: until then the host queues the
    next step. ``is_ready`` says whether the device has finished the step (a CUDA event), so
    the Trainer times a step when it ends, not when it was queued."""

    __slots__ = ("_losses", "_event")

    def __init__(self, torch, losses: list):
        self._losses, self._event = losses, None
        if losses and losses[0].is_cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    def is_ready(self) -> bool:
        return self._event is None or self._event.query()

    def __float__(self) -> float:
        return sum(loss.item() for loss in self._losses)  # (float64, in order)

    def __format__(self, spec: str) -> str:
        return format(float(self), spec)

    def __repr__(self) -> str:
        return f"LossSum({float(self)!r})"


def kept_buffers(buffers: list, skip: bool) -> list:
    """``(tensor, a copy of it)`` for each of ``buffers`` (``(name, tensor)``: BatchNorm
    statistics), which the update puts back after a skipped step (none when steps are not
    skipped: ``update.update``'s ``keep``)."""
    return [(b, b.clone()) for _, b in buffers] if skip else []


def set_lr(opt, lr: float | None) -> None:
    """This step's learning rate on every param group (None: the optimizer's own)."""
    if lr is not None:
        for group in opt.param_groups:
            group["lr"] = lr

