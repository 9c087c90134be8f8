"""Pipeline stages (``toolkit.Pipeline``) for the ``horovod-torch`` backend.

The rounds, messages, gradient reduction, evaluation plumbing, timelines and the full-model
state are the Horovod executors' shared part (``adapters/_horovod/pipeline.py``: one
``hvd.alltoall`` per lockstep round, ``[ndim, *shape, values...]`` messages, replicas' and tied
parameters' gradients summed in process sets). Here the rounds' alltoalls are asynchronous
(``hvd.alltoall_async``): a stage joins the rounds it only receives in at the step's start and
waits for a round only when an action needs its message (``adapters/_horovod/rounds.py``).

This module is the torch side: each rank holds its stage's pieces of the model
(``stages.py``), runs a piece's forward keeping its autograd graph per (micro-batch,
chunk) until that micro-batch's backward (``out.backward(grad)``; the input's ``.grad`` is the
message back), and steps a ``torch.optim`` optimizer over its stage's parameters.

The loss is the last stage's: each micro-batch's mean over its samples divided by ``M`` (the
local batch's mean, as with accumulation steps), gathered so that every rank of a replica
returns it; the Trainer's average over all ranks is then the average over replicas.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from adapters._common import check_build, check_recompute, step_seed
from adapters._horovod.pipeline import HvdPipeline, check_pipeline
from adapters._horovod.rounds import NARROW
from adapters._update import UpdateRule
from adapters.horovod_torch.models.spec import from_host, same, to_host
from adapters.horovod_torch.ops import TorchOps, kept_buffers
from adapters.horovod_torch.precision import TorchPrecision
from adapters.horovod_torch.scheduler import load_scheduler_state, scheduler_state, split_scheduler
from adapters.horovod_torch.stage_state import stage_state
from adapters.horovod_torch.stages import cut_model
from adapters.horovod_torch.torch_optim import built_over
from adapters.horovod_torch.update import sum_of_squares
from toolkit.contract import StepResult
from toolkit.parallel.layouts import Pipeline
from toolkit.parallel.pipeline.partition import micro_batch_size
from toolkit.parallel.pipeline.schedules import Action
from toolkit.precision import PRECISIONS

__all__ = ["TorchPipeline", "check_pipeline", "pack_tensors"]


def pack_tensors(torch, outgoing: dict[int, list[Any]], world_size: int, dtype, device):
    """``adapters._horovod.rounds.pack`` for torch tensors: ``outgoing[rank]``'s tensors as
    ``[ndim, *shape, values...]`` in one tensor of ``dtype`` on ``device``, rank after rank,
    and the alltoall's splits. A bfloat16 or float16 tensor in a float32 message keeps its
    dtype: its values travel as their bits, two to a float32 element (``rounds.unpack``'s
    codes), so an activation computed in 16 bits moves in half the bytes, unchanged."""
    splits, parts = [0] * world_size, []
    for r in sorted(outgoing):
        for t in outgoing[r]:
            flat = t.detach().reshape(-1).to(device)
            code = NARROW.get(str(t.dtype).removeprefix("torch."), 0) \
                if dtype == torch.float32 else 0
            if code:  # (an odd count padded by one value)
                values = torch.cat([flat, flat.new_zeros(flat.numel() % 2)]).view(dtype)
            else:
                values = flat.to(dtype)
            parts += [torch.tensor([t.dim() + 16 * code, *t.shape], dtype=dtype, device=device),
                      values]
            splits[r] += 1 + t.dim() + values.numel()
    return (torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=device)), splits


class TorchPipeline(HvdPipeline):
    """``toolkit.Pipeline`` for ``horovod-torch`` (see :class:`toolkit.Adapter`): this rank's
    stage of one replica, run by the lockstep rounds of ``adapters/_horovod/pipeline.py``."""

    backend = "horovod-torch"
    asynchronous = True  # hvd.alltoall_async: receives joined ahead (adapters/_horovod/rounds.py)
    # mixed: each stage's forward under torch autocast (as data parallel), 16-bit activations
    # sent as they are (pack_tensors), fp16's loss scaled on the last stage
    precisions = PRECISIONS
    plugin = TorchPrecision  # (adapters/_precision.py)
    recomputes = True  # activation_checkpointing: each piece's blocks (stages.cut_model)
    # pipeline x ZeRO: each stage's state sharded over its replicas (stage_state.py)
    composes = ("sharded",)
    part: Any = None  # what the stage holds and how it updates (stage_state.py), at build

    @property
    def shards(self) -> Any:
        """A sharded stage's ``ShardedParameters`` (pipeline x ZeRO), else None."""
        return getattr(self.part, "shards", None)

    @staticmethod
    def check_layout(layout: Pipeline) -> None:
        """Refused before Horovod starts (the grid needs the world size: at ``__init__``)."""

    def __init__(self, runtime, layout: Pipeline, precision: Any = None):
        super().__init__(runtime, layout, precision)
        self.torch, self.hvd, self.dtype = runtime.torch, runtime.hvd, runtime.dtype

    # ------------------------------------------------------------------------------ build
    def build(self, model: Any, optimizer: Any, loss: Any, *, seed: int = 0,
              accumulation_steps: int = 1, sync_batchnorm: bool = False,
              metrics: Any = None, clip_grad_norm: float | None = None,
              skip_nonfinite: bool = False, activation_checkpointing: bool | None = None) -> None:
        part = stage_state(self.layout)  # (its dimensions choose what the stage holds)
        self.rule = UpdateRule(optimizer if part.counts else None, clip_grad_norm,
                               skip_nonfinite, self.precision.scaler)
        torch, hvd = self.torch, self.hvd
        check_build(accumulation_steps, sync_batchnorm)
        self.ops = TorchOps(self.runtime, loss, metrics)
        self.metric_names = tuple(self.ops.metrics)
        self.seed = seed
        if isinstance(model, torch.nn.Sequential):  # rank 0's initial values, then cut
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        self.cut = cut_model(torch, model, self.pipe, self.stage, self.dtype,
                             self.runtime.dev, check_recompute("horovod-torch", model,
                                                               activation_checkpointing))
        self.native = self.cut.native
        self.params = self.cut.params()
        if not self.native:
            arrays = model.init(seed, self.runtime.dtype_name)
            with torch.no_grad():
                for name, p, to_torch, _ in self.params:
                    p.copy_(from_host(torch, arrays[name], to_torch, self.dtype, p.device))
        params = [p for _, p, _, _ in self.params]
        # the user's optimizer (a function of the parameters: over this stage's)
        optimizer, self.scheduler = split_scheduler(torch, built_over(torch, optimizer, params))
        self.part = part(self, model, optimizer)
        self.slots = self.part.slots
        self._start([n for n, *_ in self.params])

    # ------------------------------------------------------------------------------ hooks
    def _round_start(self, outgoing: dict[int, list[Any]], dtype, name: str) -> Any:
        """The round's payloads packed as ``rounds.pack`` packs them, in one tensor on the
        rank's device: on a GPU the alltoall runs on GPU memory (NCCL), and ``unpack`` reads the
        received tensor the same way."""
        buf, splits = pack_tensors(self.torch, outgoing, self.env.world_size, self.dtype,
                                   self.runtime.dev)
        self.message_bytes += buf.numel() * buf.element_size()
        return self._alltoall_start(buf, splits, name)

    def _narrow(self, words, code: int):
        torch = self.torch
        return words.view(torch.bfloat16 if code == NARROW["bfloat16"] else torch.float16)

    def _alltoall_start(self, buf, splits: list[int], name: str) -> Any:
        """``buf``: a host buffer (numpy: evaluation, buffers) or a packed round's tensor."""
        torch = self.torch
        tensor = torch.as_tensor(buf)  # kept alive (returned) until the op completes
        handle = self.hvd.alltoall_async(tensor, name=name,
                                         splits=torch.tensor(splits, dtype=torch.int32))
        return handle, tensor, not isinstance(buf, np.ndarray)

    def _alltoall_wait(self, started: Any) -> tuple[Any, list[int]]:
        got, received = self.hvd.synchronize(started[0])
        return (got if started[2] else got.numpy()), [int(n) for n in received]

    def _allgather(self, flat: np.ndarray, name: str) -> np.ndarray:
        return self.hvd.allgather(self.torch.from_numpy(flat), name=name).numpy()

    def _grouped_sum(self, tensors: list, process_set, name: str) -> list:
        return self.hvd.grouped_allreduce(tensors, op=self.hvd.Sum, name=name,
                                          process_set=process_set)

    def _squares(self, tensors: list):
        # (as data parallel adds them up)
        return sum_of_squares(self.torch, tensors, self.dtype, self.runtime.dev)

    def _host(self, tensor) -> np.ndarray:
        """(a 16-bit activation of evaluation as the parameters' dtype: exactly its value)"""
        tensor = tensor.detach()
        if tensor.is_floating_point() and tensor.element_size() < self.dtype.itemsize:
            tensor = tensor.to(self.dtype)
        return tensor.cpu().numpy()

    def _activation(self, array, grad: bool):
        """A received message (a view of a round's tensor, or a host array) as a tensor of its
        own on the rank's device."""
        torch = self.torch
        tensor = (array.clone() if torch.is_tensor(array)
                  else self.runtime.to_device(torch.from_numpy(np.array(array))))
        return tensor.requires_grad_(True) if grad else tensor

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
            with self.precision.forward_context(), self.part.forwarding():
                out = self.cut.pieces[c].forward(inp)
            if last:
                out = self.ops.per_sample(out, self.ys[m]).mean() / self.pipe.micro_batches
                self.loss += out.item()
            else:
                self.outbox[("SEND_F", m, c)] = out
            self.inputs[key], self.outputs[key] = inp, out
            self.peak_activations = max(self.peak_activations, len(self.outputs))
        else:
            out, inp = self.outputs.pop(key), self.inputs.pop(key)
            if last:  # (fp16: the last stage's loss scaled)
                self.precision.scale_loss(out).backward()
            else:
                out.backward(self.inbox_b.pop(key))
            if k > 0:
                self.outbox[("SEND_B", m, c)] = inp.grad

    def train_step(self, x: np.ndarray, y: np.ndarray, lr: float | None) -> StepResult:
        """One pipelined step on this replica's local batch; returns the replica's mean loss
        (on every rank of the replica)."""
        M = self.pipe.micro_batches
        micro_batch_size(len(x), M)  # a clear error when M does not divide the local batch
        self.part.begin(lr)  # (the step's rate, zeroed gradients)
        if self.native:
            self.torch.manual_seed(step_seed(self.seed, self.steps, self.env.rank))
        for piece in self.cut.pieces:
            for module in piece.modules:
                module.train()
        xt, yt = self.ops.tensors(x, y)
        self.xs, self.ys = xt.chunk(M), yt.chunk(M)
        kept = kept_buffers(self.cut.buffers, self.rule.skip)
        loss = self._run_rounds()
        result = self.rule.result(loss, self.part.update(kept, lr))
        self.steps += 1
        self.xs = self.ys = None
        return result

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
        """Every rank's ``(x, y)`` runs through its replica's pipeline (inputs gathered on the
        first stage, labels on the last); the last stage returns the sums of all of them and
        the other ranks zeros, so the Trainer's sum across ranks is unchanged."""
        torch, ops = self.torch, self.ops
        xs, ys = self._eval_data(x, y)
        for piece in self.cut.pieces:
            for module in piece.modules:
                module.eval()
        h = ops.tensors(xs, np.zeros(0))[0] if xs is not None else None

        def run(c: int, h):
            with self.part.forwarding():
                return self.cut.pieces[c].forward(h)

        with torch.no_grad(), self.precision.forward_context():
            h = self._through(h, run)
            self.part.let_go()
            if not self._is_eval_output():
                return self._empty_sums()
            return ops.sums(h, ops.tensors(np.zeros(0), ys)[1])

    # ------------------------------------------------------------------------------ state
    # Gathering (state_dict), checkpoint pieces (sharded_state) and replica-0 buffers
    # (sync_state) are HvdPipeline's; a tensor's owner is replica 0 of the first stage that
    # holds it (a tied tok_emb: stage 0).
    def _local(self) -> dict[str, np.ndarray]:
        """This rank's tensors under their neutral keys (each stage's, on every replica)."""
        return {**self.part.local(),
                **{f"buffers/{n}": to_host(b, same) for n, b in self.cut.buffers}}

    def _replicated(self) -> dict[str, np.ndarray]:
        out = {**self.rule.counters(), **self.part.count()}
        if self.scheduler is not None:
            out.update(scheduler_state(self.scheduler, self.part.opt))
        if self.native:
            out["rng/step"] = np.asarray(self.steps, np.int64)
        return out

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """Keeps this stage's part of the full ``state``."""
        torch = self.torch
        self.rule.load(state)
        self.part.load(state)
        with torch.no_grad():
            for n, b in self.cut.buffers:
                b.copy_(from_host(torch, state[f"buffers/{n}"], same, b.dtype, self.runtime.dev))
        if self.scheduler is not None:
            load_scheduler_state(self.scheduler, self.part.opt, state)
        if self.native:
            self.steps = int(state["rng/step"])

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds between steps (``stage_state.py``: the stage's parameters,
        gradient and optimizer slots, whole or in shards)."""
        return self.part.memory_bytes()
