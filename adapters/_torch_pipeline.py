"""Pipeline stages (``toolkit.Pipeline``) for the ``horovod-torch`` backend.

The rounds, messages, gradient reduction, evaluation plumbing, timelines and the full-model
state are the Horovod executors' shared part (``adapters/_hvd_pipeline.py``: one
``hvd.alltoall`` per lockstep round, ``[ndim, *shape, values...]`` messages, replicas' and tied
parameters' gradients summed in process sets). Here the rounds' alltoalls are asynchronous
(``hvd.alltoall_async``): a stage joins the rounds it only receives in at the step's start and
waits for a round only when an action needs its message (``adapters/_hvd_rounds.py``).

This module is the torch side: each rank holds its stage's pieces of the model
(``_torch_stages.py``), runs a piece's forward keeping its autograd graph per (micro-batch,
chunk) until that micro-batch's backward (``out.backward(grad)``; the input's ``.grad`` is the
message back), and steps a ``torch.optim`` optimizer over its stage's parameters.

The loss is the last stage's: each micro-batch's mean over its samples divided by ``M`` (the
local batch's mean, as with accumulation steps), gathered so that every rank of a replica
returns it; the Trainer's average over all ranks is then the average over replicas.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from adapters._common import check_build, loss_name, step_seed
from adapters._hvd_pipeline import HvdPipeline, check_pipeline
from adapters._torch_pipeline_state import PipelineState
from adapters._torch_stages import cut_model
from toolkit import SGD, Adam
from toolkit._layouts import Pipeline
from toolkit._partition import micro_batch_size
from toolkit._reference import optimizer_slots
from toolkit._schedules import Action

__all__ = ["TorchPipeline", "check_pipeline"]


class TorchPipeline(PipelineState, HvdPipeline):
    """Runs a ``toolkit.Pipeline`` for a ``HorovodTorchAdapter`` (its ``setup`` done), with the
    adapter contract's methods (``build``, ``train_step``, ``evaluate``, ``state_dict``, ...)."""

    asynchronous = True  # hvd.alltoall_async: receives joined ahead (adapters/_hvd_rounds.py)

    def __init__(self, adapter, layout: Pipeline):
        super().__init__(adapter.env, layout)
        self.adapter = adapter
        self.torch, self.hvd = adapter.torch, adapter.hvd

    # ------------------------------------------------------------------------------ build
    def build(self, model: Any, optimizer: Any, loss: Any, *, seed: int = 0,
              accumulation_steps: int = 1, sync_batchnorm: bool = False,
              metrics: Any = None) -> None:
        torch, hvd, a = self.torch, self.hvd, self.adapter
        check_build(a.name, optimizer, accumulation_steps, sync_batchnorm)
        # The adapter's per-sample loss and tensor conversion read these.
        a.loss_name, a.loss_fn, a.metrics = loss_name(loss), loss, dict(metrics or {})
        a.accumulation_steps, a.seed, a.sync_batchnorm = 1, seed, False
        self.seed, self.spec = seed, optimizer
        if isinstance(model, torch.nn.Sequential):  # rank 0's initial values, then cut
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        self.cut = cut_model(torch, model, self.layout, self.stage, a.dtype)
        self.native = a.native = self.cut.native
        self.params = self.cut.params()
        if not self.native:
            arrays = model.init(seed, a.dtype_name)
            with torch.no_grad():
                for name, p, to_torch, _ in self.params:
                    p.copy_(torch.tensor(np.asarray(to_torch(arrays[name])), dtype=a.dtype))
        self._build_optimizer(optimizer)
        self._start([n for n, *_ in self.params])

    def _build_optimizer(self, spec: Any) -> None:
        torch = self.torch
        params = [p for _, p, _, _ in self.params]
        if isinstance(spec, SGD):
            self.opt = torch.optim.SGD(params, lr=0.0, momentum=spec.momentum,
                                       nesterov=spec.nesterov, weight_decay=spec.weight_decay)
        else:
            cls = torch.optim.AdamW if spec.decoupled else torch.optim.Adam
            self.opt = cls(params, lr=0.0, betas=(spec.b1, spec.b2), eps=spec.eps,
                           weight_decay=spec.weight_decay)
        for p in params:  # explicit zero slots, as the data-parallel path (state from step 0)
            if isinstance(spec, SGD) and spec.momentum:
                self.opt.state[p]["momentum_buffer"] = torch.zeros_like(p)
            elif isinstance(spec, Adam):
                self.opt.state[p].update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p),
                                         exp_avg_sq=torch.zeros_like(p))
        self.slots = optimizer_slots(spec)

    # ------------------------------------------------------------------------------ hooks
    def _alltoall_start(self, buf: np.ndarray, splits: list[int], name: str) -> Any:
        torch = self.torch
        tensor = torch.from_numpy(buf)  # kept alive (returned) until the op completes
        handle = self.hvd.alltoall_async(tensor, name=name,
                                         splits=torch.tensor(splits, dtype=torch.int32))
        return handle, tensor

    def _alltoall_wait(self, started: Any) -> tuple[np.ndarray, list[int]]:
        got, received = self.hvd.synchronize(started[0])
        return got.numpy(), [int(n) for n in received]

    def _allgather(self, flat: np.ndarray, name: str) -> np.ndarray:
        return self.hvd.allgather(self.torch.from_numpy(flat), name=name).numpy()

    def _allreduce_sum(self, flat: np.ndarray, process_set, name: str) -> np.ndarray:
        return self.hvd.allreduce(self.torch.from_numpy(flat), op=self.hvd.Sum, name=name,
                                  process_set=process_set).numpy()

    def _host(self, tensor) -> np.ndarray:
        return tensor.detach().numpy()

    def _activation(self, array: np.ndarray, grad: bool):
        tensor = self.torch.from_numpy(np.array(array))  # a copy: the buffer is reused
        return tensor.requires_grad_(True) if grad else tensor

    def _gradients(self) -> dict[str, np.ndarray]:
        return {n: (p.grad.numpy() if p.grad is not None else np.zeros(tuple(p.shape),
                                                                         self.np_dtype))
                for n, p, _, _ in self.params}

    def _set_gradients(self, grads: dict[str, np.ndarray]) -> None:
        for n, p, _, _ in self.params:
            p.grad = self.torch.from_numpy(grads[n])

    def _set_buffer(self, buffer, array: np.ndarray) -> None:
        with self.torch.no_grad():
            buffer.copy_(self.torch.from_numpy(np.array(array)).to(buffer.dtype))

    # ------------------------------------------------------------------------------ steps
    def _compute(self, action: Action) -> None:
        m, c = action.micro_batch, action.chunk
        key = (m, c)
        k = c * self.grid.stages + self.stage
        last = self._is_last(c)
        if action.kind == "F":
            inp = self.xs[m] if k == 0 else self.inbox_f.pop(key)
            out = self.cut.pieces[c].forward(inp)
            if last:
                out = self.adapter._per_sample(out, self.ys[m]).mean() / self.layout.micro_batches
                self.loss += out.item()
            else:
                self.outbox[("SEND_F", m, c)] = out
            self.inputs[key], self.outputs[key] = inp, out
            self.peak_activations = max(self.peak_activations, len(self.outputs))
        else:
            out, inp = self.outputs.pop(key), self.inputs.pop(key)
            out.backward() if last else out.backward(self.inbox_b.pop(key))
            if k > 0:
                self.outbox[("SEND_B", m, c)] = inp.grad

    def train_step(self, x: np.ndarray, y: np.ndarray, lr: float | None) -> float:
        """One pipelined step on this replica's local batch; returns the replica's mean loss
        (on every rank of the replica)."""
        M = self.layout.micro_batches
        micro_batch_size(len(x), M)  # a clear error when M does not divide the local batch
        if lr is not None:
            for group in self.opt.param_groups:
                group["lr"] = lr
        if self.native:
            self.torch.manual_seed(step_seed(self.seed, self.steps, self.env.rank))
        for piece in self.cut.pieces:
            for module in piece.modules:
                module.train()
        xt, yt = self.adapter._tensors(x, y)
        self.xs, self.ys = xt.chunk(M), yt.chunk(M)
        self.opt.zero_grad(set_to_none=False)
        loss = self._run_rounds()
        self.opt.step()
        self.steps += 1
        self.xs = self.ys = None
        return loss

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
        """Every rank's ``(x, y)`` runs through its replica's pipeline (inputs gathered on the
        first stage, labels on the last); the last stage returns the sums of all of them and
        the other ranks zeros, so the Trainer's sum across ranks is unchanged."""
        torch, a = self.torch, self.adapter
        xs, ys = self._eval_data(x, y)
        for piece in self.cut.pieces:
            for module in piece.modules:
                module.eval()
        h = a._tensors(xs, np.zeros(0))[0] if xs is not None else None
        with torch.no_grad():
            h = self._through(h, lambda c, h: self.cut.pieces[c].forward(h))
            if not self._is_eval_output():
                return self._empty_sums()
            return self._sums(h, a._tensors(np.zeros(0), ys)[1])

    def _sums(self, out, yt) -> dict[str, float]:
        torch, a = self.torch, self.adapter
        n = len(out)
        result = {"loss_sum": float(a._per_sample(out, yt).sum()) if n else 0.0,
                  "count": float(n)}
        if a.loss_name == "cross_entropy":
            hits = (out.argmax(dim=-1) == yt).to(torch.float64).reshape(n, -1)
            result["correct"] = float(hits.mean(dim=1).sum()) if n else 0.0
        for name, fn in a.metrics.items():
            result[name] = float(fn(out, yt).sum()) if n else 0.0
        return result
