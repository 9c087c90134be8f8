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

import contextlib
from typing import Any

import numpy as np

from adapters._common import check_build, check_recompute, step_seed
from adapters._horovod.pipeline import HvdPipeline, check_pipeline
from adapters._horovod.rounds import NARROW
from adapters._horovod.runtime import ShardGroup
from adapters._update import UpdateRule
from adapters.horovod_torch.flat_shards import ShardedParameters, native_units, spec_units
from adapters.horovod_torch.models.spec import from_host, same, to_host
from adapters.horovod_torch.ops import (
    NEUTRAL_SLOTS,
    TORCH_SLOTS,
    TorchOps,
    count_like,
    kept_buffers,
    make_optimizer,
    set_lr,
    zero_slots,
)
from adapters.horovod_torch.precision import TorchPrecision
from adapters.horovod_torch.scheduler import load_scheduler_state, scheduler_state, split_scheduler
from adapters.horovod_torch.stages import cut_model
from adapters.horovod_torch.torch_optim import (
    built_over,
    check_elementwise,
    fill_state,
    rebind,
    slot_names,
    state_templates,
    step_count,
)
from adapters.horovod_torch.update import sum_of_squares, update
from toolkit import SGD, Adam
from toolkit.contract import StepResult
from toolkit.models.reference import optimizer_slots
from toolkit.parallel.layouts import GATHERS, Pipeline
from toolkit.parallel.pipeline.partition import micro_batch_size, tied_across_stages
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
    # pipeline x ZeRO: each stage's state sharded over its replicas (flat_shards.py)
    composes = ("sharded",)
    shards: ShardedParameters | None = None  # the stage's flat shards (pipeline x ZeRO)

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
        # (torch.optim counts its own steps; the flat shards' spec arithmetic does not)
        counted = optimizer if self.layout.dims.zero else None
        self.rule = UpdateRule(counted, clip_grad_norm, skip_nonfinite, self.precision.scaler)
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
        if self.layout.dims.zero:
            self._shard(model, optimizer)
        elif not isinstance(optimizer, SGD | Adam):  # its groups keep this stage's parameters
            check_elementwise(torch, optimizer, "horovod-torch", "pipeline")
            make_optimizer(torch, optimizer, [*params, *getattr(model, "parameters", list)()])
            templates = state_templates(torch, optimizer)
            mine = {id(p) for p in params}
            rebind(optimizer, lambda p: (p, lambda v: v) if id(p) in mine else None)
            fill_state(torch, optimizer, templates)  # as data parallel: state from step 0
            self.opt = optimizer
            self.slots = slot_names(templates)
        else:
            self.opt = make_optimizer(torch, optimizer, params)
            zero_slots(torch, self.opt, params, optimizer)
            self.slots = optimizer_slots(optimizer)
        self._start([n for n, *_ in self.params])

    def _shard(self, model: Any, optimizer: Any) -> None:
        """Pipeline x ZeRO: the stage's parameters, gradients and optimizer state in flat
        shards over the stage's replicas (``flat_shards.ShardedParameters``, its group the
        stage's process set), gathered once per step unless the layout says
        ``gather=micro-batch``."""
        torch, dims = self.torch, self.layout.dims
        if not isinstance(optimizer, SGD | Adam):  # the user's torch.optim optimizer
            check_elementwise(torch, optimizer, "horovod-torch", self.layout.name)
            make_optimizer(torch, optimizer, [*(p for _, p, _, _ in self.params),
                                              *getattr(model, "parameters", list)()])
        if self.native:
            native_units(torch, self.cut.root)  # (refuses what cannot be sharded)
        arrays = {n: to_host(p, from_torch) for n, p, _, from_torch in self.params}
        units: dict[str, list[str]] = {}
        for n in arrays:  # a native layer's parameters a unit (as native_units groups them)
            units.setdefault(n.split(".")[0], []).append(n)
        units, whole = self._tied_unit(units if self.native else spec_units(arrays))
        stage_set = self._process_set(self.grid.stage_ranks(self.stage))
        group = ShardGroup(self.replica, self.grid.replicas, stage_set, None, self.replica == 0)
        self.shards = ShardedParameters(
            torch, self.hvd, self.cut.root, self.params, arrays, units, dims.zero, optimizer,
            self.dtype, self.runtime.dev, None if self.native else self.precision.autocast,
            group=group, hold=dims.gather == GATHERS[0], whole=whole)
        self.opt = self.shards.native  # (None: the spec's arithmetic on the shards)
        self.slots = tuple(self.shards.slot_names)

    def _tied_unit(self, units: dict[str, list[str]]) -> tuple[dict[str, list[str]], dict]:
        """``units`` with the parameters two stages hold (a tied embedding, on the end
        stages) taken out into a unit of their own, the same on both stages, and that unit's
        reduction: its whole gradient summed over both end stages' ranks (the end stages'
        process set) and averaged over the replicas, as the pipeline sums a tied gradient."""
        tied = set(tied_across_stages(self.cut.names_by_stage, self.pipe))
        mine = [n for names in units.values() for n in names if n in tied]
        if not mine:
            return units, {}
        out = {u: [n for n in names if n not in tied] for u, names in units.items()}
        out = {u: names for u, names in out.items() if names}
        out["tied"] = mine
        ends, hvd, replicas = self._process_set(self.grid.end_ranks()), self.hvd, \
            self.grid.replicas

        def reduce(flat):
            return hvd.allreduce(flat, op=hvd.Sum, name="zero.grad.tied",
                                 process_set=ends) / replicas

        return out, {"tied": reduce}

    def _forwarding(self):
        """What each forward runs inside: the flat shards' (ZeRO re-routes the parameters)."""
        return self.shards.forwarding() if self.shards is not None else contextlib.nullcontext()

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
            with self.precision.forward_context(), self._forwarding():
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
        if self.opt is not None:
            set_lr(self.opt, lr)
        if self.native:
            self.torch.manual_seed(step_seed(self.seed, self.steps, self.env.rank))
        for piece in self.cut.pieces:
            for module in piece.modules:
                module.train()
        xt, yt = self.ops.tensors(x, y)
        self.xs, self.ys = xt.chunk(M), yt.chunk(M)
        if self.shards is not None:
            self.shards.zero_grad()
        else:
            self.opt.zero_grad(set_to_none=False)
        kept = kept_buffers(self.cut.buffers, self.rule.skip)
        scalars = self.rule.scalars(lr)  # (the spec's count: the flat shards' arithmetic)
        loss = self._run_rounds()
        norm = (self._update(kept) if self.shards is None
                else self._update_shards(scalars, kept))
        result = self.rule.result(loss, norm)
        self.steps += 1
        self.xs = self.ys = None
        return result

    def _update(self, kept: list) -> Any:
        """The stage's gradients reduced on the device (``_reduced``), then the family's one
        update path (``update.update``: unscale, norm over every stage, finite check, clip,
        the optimizer's step; ``kept``: the buffers' values before the step, put back when
        it is skipped). Returns the norm."""
        torch = self.torch
        grads = self._reduced({n: torch.zeros_like(p) if p.grad is None else p.grad
                               for n, p, _, _ in self.params})
        for n, p, _, _ in self.params:
            p.grad = grads[n]

        def apply(_) -> None:  # (the skip is known on the host here)
            self.opt.step()
            if self.scheduler is not None:
                self.scheduler.step()

        return update(torch, self.rule, list(grads.values()),
                      lambda _: self._sum_of_squares(grads), apply, kept)[1]

    def _update_shards(self, scalars: Any, kept: list) -> Any:
        """Pipeline x ZeRO: the stage's gradient shards reduced over its replicas
        (``ShardedParameters.reduce``), then the same update path: the norm's squares summed
        over every stage's shards (stage 1's ranks each hold their stage's whole gradient:
        counted once per replica set), the shards' step."""
        torch, shards = self.torch, self.shards
        shards.reduce()

        def squares(grads: list):  # (a tied unit's counted on the first stage)
            mine = self._squares([g for u, g in enumerate(grads)
                                  if self.stage == 0 or u not in shards.whole])
            total, = self._grouped_sum([mine], self.hvd.global_process_set,
                                       "pipeline.grad_norm")
            return total / self.grid.replicas if shards.stage == 1 else total

        def apply(found_inf) -> None:
            shards.step(scalars, found_inf)
            if self.scheduler is not None:
                self.scheduler.step()

        return update(torch, self.rule, shards.grads, squares, apply, kept)[1]

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
            with self._forwarding():
                return self.cut.pieces[c].forward(h)

        with torch.no_grad(), self.precision.forward_context():
            h = self._through(h, run)
            if self.shards is not None:
                self.shards.let_go()
            if not self._is_eval_output():
                return self._empty_sums()
            return ops.sums(h, ops.tensors(np.zeros(0), ys)[1])

    # ------------------------------------------------------------------------------ state
    # Gathering (state_dict), checkpoint pieces (sharded_state) and replica-0 buffers
    # (sync_state) are HvdPipeline's; a tensor's owner is replica 0 of the first stage that
    # holds it (a tied tok_emb: stage 0).
    def _local(self) -> dict[str, np.ndarray]:
        """This rank's tensors under their neutral keys (each stage's, on every replica;
        sharded: gathered over the stage's replicas)."""
        if self.shards is not None:
            out = {k: v for k, v in self.shards.state_dict().items() if k != "opt/count"}
            return {**out, **{f"buffers/{n}": to_host(b, same) for n, b in self.cut.buffers}}
        out = {}
        for n, p, _, from_torch in self.params:
            out[f"params/{n}"] = to_host(p, from_torch)
            for slot in self.slots:  # (zeros where the parameter's group keeps no such slot)
                value = self.opt.state[p].get(TORCH_SLOTS.get(slot, slot))
                out[f"opt/{slot}/{n}"] = to_host(value if value is not None
                                                 else self.torch.zeros_like(p), from_torch)
        for n, b in self.cut.buffers:
            out[f"buffers/{n}"] = to_host(b, same)
        return out

    def _replicated(self) -> dict[str, np.ndarray]:
        out = dict(self.rule.counters())  # (a spec optimizer's count on the flat shards)
        count = step_count(self.torch, self.opt) if self.opt is not None else None
        if count is not None:
            out["opt/count"] = np.asarray(count, np.int64)
        if self.scheduler is not None:
            out.update(scheduler_state(self.scheduler, self.opt))
        if self.native:
            out["rng/step"] = np.asarray(self.steps, np.int64)
        return out

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """Keeps this stage's part of the full ``state``."""
        torch, dtype, dev = self.torch, self.dtype, self.runtime.dev

        def tensor(a, to_torch, dt=dtype):
            return from_host(torch, a, to_torch, dt, dev)

        self.rule.load(state)
        if self.shards is not None:
            self.shards.load_state_dict(state)
        with torch.no_grad():
            for n, p, to_torch, _ in ([] if self.shards is not None else self.params):
                p.copy_(tensor(state[f"params/{n}"], to_torch))
                slots = self.opt.state[p]
                for key in list(slots):
                    slots[key] = (count_like(torch, slots[key], state["opt/count"])
                                  if key == "step" else
                                  tensor(state[f"opt/{NEUTRAL_SLOTS.get(key, key)}/{n}"], to_torch))
            for n, b in self.cut.buffers:
                b.copy_(tensor(state[f"buffers/{n}"], same, b.dtype))
        if self.scheduler is not None:
            load_scheduler_state(self.scheduler, self.opt, state)
        if self.native:
            self.steps = int(state["rng/step"])

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds between steps: its stage's parameters, a gradient of each,
        and their optimizer slots (a tied parameter counts on both stages that hold it);
        sharded, the flat shards' buffers."""
        if self.shards is not None:
            return self.shards.memory_bytes()
        params = sum(p.nbytes for _, p, _, _ in self.params)
        slots = sum(v.nbytes for p in (e[1] for e in self.params)
                    for v in self.opt.state[p].values() if self.torch.is_tensor(v) and v.dim())
        return {"params": params, "grads": params, "optimizer": slots}
