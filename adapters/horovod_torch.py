"""The ``horovod-torch`` backend: PyTorch with Horovod's allreduce.

One step is forward, backward, Horovod's gradient allreduce (averaged; hooks fire as each
gradient is ready and ``DistributedOptimizer.step`` waits for them), then the optimizer update.

A native ``nn.Module`` brings all of its state: parameters under ``params/<torch name>``,
registered buffers (BatchNorm running statistics and counters) under ``buffers/<torch name>``.
Buffers are broadcast from rank 0 at the start, and again before every evaluation and
checkpoint (``sync_state``), unless ``sync_batchnorm`` keeps them equal on every rank by
computing BatchNorm statistics over the global batch (Horovod's ``SyncBatchNorm``). Dropout and
other torch randomness is seeded per step from (seed, step, rank), so a resumed run draws
what an uninterrupted one would have.

Under ``toolkit.Sharded(stage=1|2|3)`` (ZeRO / FSDP) the parameters, gradients and optimizer
state live in flat per-unit shards instead (``adapters/_torch_sharded.py``); the step is the
same loop with that object in the optimizer's place.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import numpy as np

from adapters._common import (
    BackendBase,
    check_per_sample,
    check_world,
    loss_name,
    missing_framework,
    step_seed,
)
from adapters._hvd_layout import HvdPipelineAbility
from adapters._torch_models import build_spec_model, same, to_host
from adapters._torch_scheduler import load_scheduler_state, scheduler_state, split_scheduler
from adapters._torch_sync_bn import convert_sync_batchnorm
from toolkit import SGD, Adam, LaunchEnv, ToolkitError
from toolkit._specs import ModelSpec, check_choice

# Neutral optimizer-state names (the checkpoint format's) <-> torch.optim state keys.
_SLOTS = {"momentum_buffer": "momentum", "exp_avg": "mu", "exp_avg_sq": "nu"}


class HorovodTorchAdapter(HvdPipelineAbility, BackendBase):
    """PyTorch + Horovod. See :class:`toolkit.Adapter` for the contract."""

    name = "horovod-torch"
    sharding = None  # the toolkit.Sharded layout, when set_layout chose one
    shards = None  # its adapters._torch_sharded.ShardedParameters, after build
    scheduler = None  # a torch LR scheduler given with a native optimizer, after build
    executor = "adapters._torch_pipeline:TorchPipeline"  # under a toolkit.Pipeline

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
        self._init_horovod(hvd, env)
        check_world(self.name, env, hvd.size(), hvd.rank())
        # Ranks on one node share its cores; oversubscribed intra-op threads slow every rank.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.local_size))
        self.dtype = {"float32": torch.float32, "float64": torch.float64}[self.dtype_name]

    def set_layout(self, layout: Any) -> None:
        """Shards (``toolkit.Sharded``) or cuts into stages (``toolkit.Pipeline``) what
        ``build`` creates, as ``layout`` says."""
        from adapters._torch_sharded import check_layout

        if not self._set_pipeline(layout):
            self.sharding = check_layout(layout)

    def build(self, model: Any, optimizer: Any, loss: Any, *, seed: int = 0,
              accumulation_steps: int = 1, sync_batchnorm: bool = False,
              metrics: Any = None) -> None:
        if self.pipeline is not None:
            return self.pipeline.build(
                model, optimizer, loss, seed=seed, accumulation_steps=accumulation_steps,
                sync_batchnorm=sync_batchnorm, metrics=metrics)
        torch, hvd = self.torch, self.hvd
        self.loss_name, self.loss_fn = loss_name(loss), loss
        self.metrics = dict(metrics or {})
        self.accumulation_steps, self.seed = accumulation_steps, seed
        self.native = not isinstance(model, ModelSpec)
        if not self.native:
            self.net, self.layout = build_spec_model(torch, model)
            self.net.to(self.dtype)
            if self.sharding is None:
                self._load_params(model.init(seed, self.dtype_name))
        elif isinstance(model, torch.nn.Module):
            self.net = model.to(self.dtype)
            if sync_batchnorm:
                convert_sync_batchnorm(torch, hvd, self.net)
            self.layout = [(n, p, same, same) for n, p in self.net.named_parameters()]
        else:
            raise ToolkitError(f"horovod-torch cannot build a model from {type(model).__name__}",
                               "pass a toolkit.MLP/CNN/GPT spec or a torch.nn.Module")
        self.sync_batchnorm = sync_batchnorm
        self.buffers = [(n, b) for n, b in self.net.named_buffers() if b is not None]
        self.steps = 0  # optimizer steps taken: the randomness of the next one derives from it
        optimizer, self.scheduler = split_scheduler(torch, optimizer)
        if self.sharding is not None:
            self._build_sharded(model, optimizer, seed)
            return
        # DistributedOptimizer builds a new optimizer over the same param groups (with empty
        # state), so slots are filled in after wrapping, before the state is broadcast.
        self.opt = hvd.DistributedOptimizer(
            self._optimizer(optimizer), named_parameters=self.net.named_parameters(),
            op=hvd.Average, backward_passes_per_step=accumulation_steps)
        self._zero_slots(optimizer)
        hvd.broadcast_parameters(self.net.state_dict(), root_rank=0)  # parameters and buffers
        fresh = [p.detach().clone() for p in self.net.parameters()] if not self.opt.state else []
        hvd.broadcast_optimizer_state(self.opt, root_rank=0)
        if fresh:  # Horovod made the state with a zero-gradient step (weight decay, count): undo
            with torch.no_grad():
                for p, before in zip(self.net.parameters(), fresh, strict=True):
                    p.copy_(before)
                for slots in self.opt.state.values():
                    for value in slots.values():
                        if torch.is_tensor(value):
                            value.zero_()

    def _build_sharded(self, model: Any, optimizer: Any, seed: int) -> None:
        from adapters._torch_sharded import ShardedParameters, native_units, spec_units

        if self.native:
            units = native_units(self.torch, self.net, optimizer)
            self.hvd.broadcast_parameters(self.net.state_dict(), root_rank=0)
            arrays = {n: to_host(p, same) for n, p in self.net.named_parameters()}
        else:
            arrays = model.init(seed, self.dtype_name)
            units = spec_units(arrays)
            if not isinstance(optimizer, SGD | Adam):
                native_units(self.torch, self.net, optimizer)  # its error for the optimizer
        self.shards = ShardedParameters(self.torch, self.hvd, self.net, self.layout, arrays,
                                        units, self.sharding.stage, optimizer, self.dtype)
        self.layout = None  # the module's parameters are gone: the flat buffers hold them

    def _optimizer(self, spec: Any):
        torch = self.torch
        params = list(self.net.parameters())
        if isinstance(spec, SGD):
            return torch.optim.SGD(params, lr=0.0, momentum=spec.momentum,
                                   nesterov=spec.nesterov, weight_decay=spec.weight_decay)
        if isinstance(spec, Adam):
            cls = torch.optim.AdamW if spec.decoupled else torch.optim.Adam
            return cls(params, lr=0.0, betas=(spec.b1, spec.b2), eps=spec.eps,
                       weight_decay=spec.weight_decay)
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
        raise ToolkitError(f"horovod-torch cannot build an optimizer from {spec!r}",
                           "pass toolkit.SGD(...)/toolkit.Adam(...) or a torch.optim "
                           "optimizer over the model's parameters")

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
        xt = torch.as_tensor(x)
        if xt.is_floating_point():
            xt = xt.to(self.dtype)
        ydtype = torch.long if self.loss_name == "cross_entropy" else None
        yt = torch.as_tensor(y, dtype=ydtype)
        if yt.is_floating_point():
            yt = yt.to(self.dtype)
        return xt, yt

    def _per_sample(self, out, y):
        """One loss per sample: a token-level loss is averaged over the sample's tokens."""
        f = self.torch.nn.functional
        if self.loss_name == "custom":
            losses = self.loss_fn(out, y)
            check_per_sample(losses.shape, len(out))
            return losses
        if self.loss_name == "cross_entropy":
            tokens = f.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1),
                                     reduction="none")
            return tokens.reshape(len(out), -1).mean(dim=1)
        return ((out - y.reshape(out.shape)) ** 2).reshape(len(out), -1).mean(dim=1)

    def _mean_loss(self, out, y):
        """The batch's mean loss. Every sample has the same number of positions, so for the
        cross-entropy it is torch's own mean over all of them, one fused op (per-sample means
        and their mean made the step 1-1.5% slower on a 9 ms MLP step, measured)."""
        if self.loss_name == "cross_entropy":  # (the sum over numel: every position counts)
            return self.torch.nn.functional.cross_entropy(
                out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="sum") / y.numel()
        return self._per_sample(out, y).mean()

    def _forwarding(self):
        return self.shards.forwarding() if self.shards else contextlib.nullcontext()

    def train_step(self, x: np.ndarray, y: np.ndarray, lr: float | None) -> float:
        if self.pipeline is not None:
            return self.pipeline.train_step(x, y, lr)
        if lr is not None and self.shards is None:
            for group in self.opt.param_groups:
                group["lr"] = lr
        if self.native:
            self.torch.manual_seed(step_seed(self.seed, self.steps, self.env.rank))
        self.net.train()
        xt, yt = self._tensors(x, y)
        k = self.accumulation_steps
        (self.shards or self.opt).zero_grad()
        total = 0.0
        for xc, yc in zip(xt.chunk(k), yt.chunk(k), strict=True):
            with self._forwarding():
                loss = self._mean_loss(self.net(xc), yc)
            if k > 1:
                loss = loss / k
            loss.backward()
            total += loss.item()
        self.opt.step() if self.shards is None else self.shards.step(lr)
        if self.scheduler is not None:
            self.scheduler.step()
        self.steps += 1
        return total

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
        if self.pipeline is not None:
            return self.pipeline.evaluate(x, y)
        torch = self.torch
        self.net.eval()
        xt, yt = self._tensors(x, y)
        with torch.no_grad(), self._forwarding():
            out = self.net(xt)
            result = {"loss_sum": float(self._per_sample(out, yt).sum()), "count": float(len(x))}
            if self.loss_name == "cross_entropy":
                hits = (out.argmax(dim=-1) == yt).to(torch.float64).reshape(len(x), -1)
                result["correct"] = float(hits.mean(dim=1).sum())
            for name, fn in self.metrics.items():
                values = fn(out, yt)
                check_per_sample(values.shape, len(x), what=f"metric {name!r}")
                result[name] = float(values.sum())
        return result

    # -------------------------------------------------------------------------- collectives
    def allreduce(self, values: np.ndarray, op: str = "mean") -> np.ndarray:
        check_choice("reduction", op, ("mean", "sum"))
        hvd = self.hvd
        tensor = self.torch.as_tensor(np.asarray(values, np.float64))
        # Named: unnamed ops are numbered per process, and under a pipeline the ranks of
        # different stages have made different numbers of (process-set) ops.
        out = hvd.allreduce(tensor, op=hvd.Average if op == "mean" else hvd.Sum,
                            name="toolkit.allreduce")
        return out.numpy()

    def broadcast(self, values: np.ndarray, root: int = 0) -> np.ndarray:
        return self.hvd.broadcast(self.torch.as_tensor(np.asarray(values)), root_rank=root,
                                  name="toolkit.broadcast").numpy()

    def barrier(self) -> None:
        self.hvd.barrier()

    def sync_state(self) -> None:
        """Rank 0's buffers (BatchNorm statistics) become every rank's."""
        if self.pipeline is not None:
            return self.pipeline.sync_state()
        if self.env.world_size > 1 and self.buffers and not self.sync_batchnorm:
            self.hvd.broadcast_parameters(self.buffers, root_rank=0)

    # -------------------------------------------------------------------------- state
    def _load_params(self, params: dict[str, np.ndarray]) -> None:
        self.load_state_dict({f"params/{k}": v for k, v in params.items()}, params_only=True)

    def sharded_state(self):
        """This rank's pieces of the sharded state (see ``toolkit.ShardedAdapter``)."""
        if self.pipeline is not None:
            return self.pipeline.sharded_state()
        if self.shards is None:
            raise ToolkitError("sharded_state() needs a Sharded layout",
                               "build under toolkit.Sharded(stage=...), or use state_dict()")
        replicated, pieces = self.shards.sharded_state()
        return {**replicated, **self._model_state()}, pieces

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for parameters, gradients and optimizer state. Data parallel:
        every parameter, a gradient of each parameter's size, every optimizer slot."""
        if self.pipeline is not None:
            return self.pipeline.memory_bytes()
        if self.shards is not None:
            return self.shards.memory_bytes()
        params = sum(p.nbytes for _, p, _, _ in self.layout)
        slots = sum(v.nbytes for state in self.opt.state.values() for v in state.values()
                    if self.torch.is_tensor(v))
        return {"params": params, "grads": params, "optimizer": slots}

    def _model_state(self) -> dict[str, np.ndarray]:
        """Buffers, and the step the randomness of native models derives from."""
        out = {f"buffers/{name}": to_host(b, same) for name, b in self.buffers}
        if self.native:
            out["rng/step"] = np.asarray(self.steps, np.int64)
        return out

    def state_dict(self) -> dict[str, np.ndarray]:
        if self.pipeline is not None:
            return self.pipeline.state_dict()
        if self.shards is not None:
            return {**self.shards.state_dict(), **self._model_state()}
        out, step = {}, None
        for name, p, _, from_torch in self.layout:
            out[f"params/{name}"] = to_host(p, from_torch)
            for key, value in self.opt.state.get(p, {}).items():
                if key == "step":
                    step = int(value)
                else:
                    out[f"opt/{_SLOTS.get(key, key)}/{name}"] = to_host(value, from_torch)
        if step is not None:
            out["opt/count"] = np.asarray(step, np.int64)
        if self.scheduler is not None:
            out.update(scheduler_state(self.scheduler, self.opt))
        return {**out, **self._model_state()}

    def load_state_dict(self, state: dict[str, np.ndarray], params_only: bool = False) -> None:
        if self.pipeline is not None:
            return self.pipeline.load_state_dict(state)
        torch = self.torch

        def tensor(a, to_torch, dtype=self.dtype):  # a copy: never alias the caller's array
            return torch.tensor(np.asarray(to_torch(np.asarray(a))), dtype=dtype)

        with torch.no_grad():
            for name, p, to_torch, _ in self.layout if self.shards is None else ():
                p.copy_(tensor(state[f"params/{name}"], to_torch))
                if params_only:
                    continue
                slots = self.opt.state.get(p, {})
                for key in list(slots):
                    if key == "step":
                        slots["step"] = torch.tensor(float(state["opt/count"]))
                    else:
                        slots[key] = tensor(state[f"opt/{_SLOTS.get(key, key)}/{name}"], to_torch)
            if params_only:
                return
            if self.shards is not None:
                self.shards.load_state_dict(state)
            if self.scheduler is not None:
                load_scheduler_state(self.scheduler, self.opt, state)
            for name, b in self.buffers:
                b.copy_(tensor(state[f"buffers/{name}"], same, b.dtype))
        if self.native:
            self.steps = int(state["rng/step"])


    def shutdown(self) -> None:
        self.hvd.shutdown()
