"""The ``horovod-torch`` backend: PyTorch with Horovod's allreduce.

One step is forward, backward, Horovod's gradient allreduce (averaged; hooks fire as each
gradient is ready and ``DistributedOptimizer.step`` waits for them), then the optimizer update.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from adapters._common import BackendBase, check_world, missing_framework
from toolkit import CNN, MLP, SGD, Adam, LaunchEnv, ToolkitError
from toolkit._specs import check_choice

# Neutral optimizer-state names (the checkpoint format's) <-> torch.optim state keys.
_SLOTS = {"momentum_buffer": "momentum", "exp_avg": "mu", "exp_avg_sq": "nu"}



class HorovodTorchAdapter(BackendBase):
    """PyTorch + Horovod. See :class:`toolkit.Adapter` for the contract."""

    name = "horovod-torch"

    # -------------------------------------------------------------------------- set-up
    def setup(self, env: LaunchEnv) -> None:
        try:
            import torch
        except ImportError as err:
            raise missing_framework(self.name, "PyTorch", err) from err
        try:
            import horovod.torch as hvd
        except ImportError as err:
            raise missing_framework(self.name, "Horovod built with PyTorch support", err) from err
        self.torch, self.hvd, self.env = torch, hvd, env
        hvd.init()
        check_world(self.name, env, hvd.size(), hvd.rank())
        # Ranks on one node share its cores; oversubscribed intra-op threads slow every rank.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.local_size))
        self.dtype = {"float32": torch.float32, "float64": torch.float64}[self.dtype_name]

    def build(self, model: Any, optimizer: Any, loss: str, *, seed: int = 0,
              accumulation_steps: int = 1) -> None:
        torch, hvd = self.torch, self.hvd
        self.loss_name, self.accumulation_steps = loss, accumulation_steps
        if isinstance(model, MLP | CNN):
            self.net, self.layout = _from_spec(torch, model)
            self.net.to(self.dtype)
            self._load_params(model.init(seed, self.dtype_name))
        elif isinstance(model, torch.nn.Module):
            self.net = model.to(self.dtype)
            self.layout = [(n, p, _SAME, _SAME) for n, p in self.net.named_parameters()]
        else:
            raise ToolkitError(f"horovod-torch cannot build a model from {type(model).__name__}",
                               "pass a toolkit.MLP/CNN spec or a torch.nn.Module")
        # DistributedOptimizer builds a new optimizer over the same param groups (with empty
        # state), so slots are filled in after wrapping, before the state is broadcast.
        self.opt = hvd.DistributedOptimizer(
            self._optimizer(optimizer), named_parameters=self.net.named_parameters(),
            op=hvd.Average, backward_passes_per_step=accumulation_steps)
        self._zero_slots(optimizer)
        hvd.broadcast_parameters(self.net.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(self.opt, root_rank=0)

    def _optimizer(self, spec: Any):
        torch = self.torch
        params = list(self.net.parameters())
        if isinstance(spec, SGD):
            opt = torch.optim.SGD(params, lr=0.0, momentum=spec.momentum, nesterov=spec.nesterov,
                                  weight_decay=spec.weight_decay)
        elif isinstance(spec, Adam):
            cls = torch.optim.AdamW if spec.decoupled else torch.optim.Adam
            opt = cls(params, lr=0.0, betas=(spec.b1, spec.b2), eps=spec.eps,
                      weight_decay=spec.weight_decay)
        elif isinstance(spec, torch.optim.Optimizer):
            return spec
        else:
            raise ToolkitError(f"horovod-torch cannot build an optimizer from {spec!r}",
                               "pass toolkit.SGD(...)/toolkit.Adam(...) or a torch.optim "
                               "optimizer over the model's parameters")
        return opt

    def _zero_slots(self, spec: Any) -> None:
        """Explicit zero optimizer state, so that state_dict() names every slot from step 0.

        Zero buffers give exactly the update of torch's lazy initialisation, and they keep
        Horovod's broadcast_optimizer_state from running a dummy step (which would advance
        Adam's step count).
        """
        torch = self.torch
        for p in self.net.parameters():
            if isinstance(spec, SGD) and spec.momentum:
                self.opt.state[p]["momentum_buffer"] = torch.zeros_like(p)
            elif isinstance(spec, Adam):
                self.opt.state[p].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p),
                                         exp_avg_sq=torch.zeros_like(p))

    # -------------------------------------------------------------------------- steps
    def _tensors(self, x: np.ndarray, y: np.ndarray):
        torch = self.torch
        xt = torch.as_tensor(x, dtype=self.dtype)
        yt = torch.as_tensor(y, dtype=torch.long if self.loss_name == "cross_entropy"
                             else self.dtype)
        return xt, yt

    def _loss(self, out, y, reduction: str = "mean"):
        f = self.torch.nn.functional
        if self.loss_name == "cross_entropy":
            return f.cross_entropy(out, y, reduction=reduction)
        per_sample = ((out - y.reshape(out.shape)) ** 2).mean(dim=tuple(range(1, out.ndim)))
        return per_sample.mean() if reduction == "mean" else per_sample.sum()

    def train_step(self, x: np.ndarray, y: np.ndarray, lr: float | None) -> float:
        if lr is not None:
            for group in self.opt.param_groups:
                group["lr"] = lr
        self.net.train()
        xt, yt = self._tensors(x, y)
        k = self.accumulation_steps
        self.opt.zero_grad()
        total = 0.0
        for xc, yc in zip(xt.chunk(k), yt.chunk(k), strict=True):
            loss = self._loss(self.net(xc), yc) / k
            loss.backward()
            total += loss.item()
        self.opt.step()
        return total

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
        torch = self.torch
        self.net.eval()
        xt, yt = self._tensors(x, y)
        with torch.no_grad():
            out = self.net(xt)
            result = {"loss_sum": float(self._loss(out, yt, "sum")), "count": float(len(x))}
            if self.loss_name == "cross_entropy":
                result["correct"] = float((out.argmax(dim=1) == yt).sum())
        return result

    # -------------------------------------------------------------------------- collectives
    def allreduce(self, values: np.ndarray, op: str = "mean") -> np.ndarray:
        check_choice("reduction", op, ("mean", "sum"))
        hvd = self.hvd
        tensor = self.torch.as_tensor(np.asarray(values, np.float64))
        out = hvd.allreduce(tensor, op=hvd.Average if op == "mean" else hvd.Sum)
        return out.numpy()

    def broadcast(self, values: np.ndarray, root: int = 0) -> np.ndarray:
        return self.hvd.broadcast(self.torch.as_tensor(np.asarray(values)), root_rank=root).numpy()

    def barrier(self) -> None:
        self.hvd.barrier()

    # -------------------------------------------------------------------------- state
    def _load_params(self, params: dict[str, np.ndarray]) -> None:
        self.load_state_dict({f"params/{k}": v for k, v in params.items()}, params_only=True)

    def state_dict(self) -> dict[str, np.ndarray]:
        out, step = {}, None
        for name, p, _, from_torch in self.layout:
            out[f"params/{name}"] = _host(p, from_torch)
            for key, value in self.opt.state.get(p, {}).items():
                if key == "step":
                    step = int(value)
                else:
                    out[f"opt/{_SLOTS.get(key, key)}/{name}"] = _host(value, from_torch)
        if step is not None:
            out["opt/count"] = np.asarray(step, np.int64)
        return out

    def load_state_dict(self, state: dict[str, np.ndarray], params_only: bool = False) -> None:
        torch = self.torch

        def tensor(a, to_torch):  # a copy: never alias the caller's array
            return torch.tensor(np.asarray(to_torch(np.asarray(a))), dtype=self.dtype)

        with torch.no_grad():
            for name, p, to_torch, _ in self.layout:
                p.copy_(tensor(state[f"params/{name}"], to_torch))
                if params_only:
                    continue
                slots = self.opt.state.get(p, {})
                for key in list(slots):
                    if key == "step":
                        slots["step"] = torch.tensor(float(state["opt/count"]))
                    else:
                        slots[key] = tensor(state[f"opt/{_SLOTS.get(key, key)}/{name}"], to_torch)

    def shutdown(self) -> None:
        self.hvd.shutdown()


def _SAME(a):
    return a


def _T(a):
    return a.T


def _hwio_to_oihw(a):
    return a.transpose(3, 2, 0, 1)


def _oihw_to_hwio(a):
    return a.transpose(2, 3, 1, 0)


def _host(t, from_torch) -> np.ndarray:
    # .numpy() shares the tensor's memory: always copy.
    return np.array(from_torch(t.detach().cpu().numpy()), order="C", copy=True)


def _from_spec(torch, spec):
    """A torch module for a spec, and the (neutral name, parameter, to torch, from torch)
    layout that maps between the spec's arrays and torch's own layouts."""
    nn = torch.nn
    if isinstance(spec, MLP):
        act = torch.relu if spec.activation == "relu" else torch.tanh

        class TorchMLP(nn.Module):
            def __init__(self):
                super().__init__()
                self.layers = nn.ModuleList(
                    nn.Linear(a, b) for a, b in zip(spec.sizes[:-1], spec.sizes[1:], strict=True))

            def forward(self, x):
                for i, layer in enumerate(self.layers):
                    x = layer(x)
                    if i < len(self.layers) - 1:
                        x = act(x)
                return x

        net = TorchMLP()
        layout = []
        for i, layer in enumerate(net.layers):
            layout += [(f"layers.{i}.kernel", layer.weight, _T, _T),
                       (f"layers.{i}.bias", layer.bias, _SAME, _SAME)]
        return net, layout

    h, w, c = spec.image_shape
    widths = (c, *spec.channels)

    class TorchCNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.convs = nn.ModuleList(
                nn.Conv2d(a, b, spec.kernel_size, padding=spec.kernel_size // 2)
                for a, b in zip(widths[:-1], widths[1:], strict=True))
            self.head = nn.Linear(h * w * widths[-1], spec.classes)

        def forward(self, x):
            x = x.permute(0, 3, 1, 2)  # the spec's NHWC -> torch's NCHW
            for conv in self.convs:
                x = torch.relu(conv(x))
            return self.head(x.permute(0, 2, 3, 1).reshape(len(x), -1))  # flatten as (h, w, c)

    net = TorchCNN()
    layout = []
    for i, conv in enumerate(net.convs):
        layout += [(f"convs.{i}.kernel", conv.weight, _hwio_to_oihw, _oihw_to_hwio),
                   (f"convs.{i}.bias", conv.bias, _SAME, _SAME)]
    layout += [("head.kernel", net.head.weight, _T, _T), ("head.bias", net.head.bias, _SAME, _SAME)]
    return net, layout
