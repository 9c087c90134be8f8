"""Pipeline stages (``toolkit.Pipeline``) for the ``horovod-torch`` backend.

The world's ``S x D`` ranks are ``D`` data-parallel replicas of an ``S``-stage pipeline
(``toolkit.PipelineGrid``: rank ``r`` is stage ``r // D`` of replica ``r % D``). Each rank holds
its stage's pieces of the model (``_torch_stages.py``) and runs its stage's actions of the
schedule (``toolkit.pipeline_schedule``: gpipe, 1f1b, interleaved-1f1b), regrouped into
lockstep rounds (``toolkit.lockstep_rounds``): each round every rank runs at most one forward or
backward, then the round's messages move in **one** ``hvd.alltoall`` over the whole world, with
a split for each receiving rank and zero for the others. Every rank calls it once per round
(rounds without messages are skipped everywhere), so nothing can deadlock, under any launcher,
with a plain ``hvd.init()``. (Horovod has no send/recv. Process sets would need registering at
``hvd.init``, before the layout is known, or dynamic process sets; re-initialising is
impossible under MPI.) A message is a flat buffer ``[ndim, *shape, values...]``.

After the rounds, the gradients are averaged across the ``D`` replicas of each stage with one
more alltoall: every rank sends its flat gradient to each rank of its stage (itself included)
and sums the copies in rank order, so every replica applies the same bits. A parameter held by
two stages (a tied GPT's ``tok_emb``: the embedding on the first stage, the head on the last)
also goes to the other stage's ranks: both sum the same ``2 x D`` contributions in the same
order and apply the same update, so the two copies never drift (Megatron-LM's embedding group).

The loss is the last stage's: each micro-batch's mean over its samples divided by ``M`` (the
local batch's mean, as with accumulation steps), gathered so that every rank of a replica
returns it; the Trainer's average over all ranks is then the average over replicas.

Every compute is timed into a ``toolkit.StageRecorder`` (sends and receives span the round's
alltoall). Set the environment variable ``TOOLKIT_PIPELINE_TIMELINE=DIR`` (or the executor's
``timeline_dir``) and each rank appends its records to ``DIR/stage<S>-replica<D>.jsonl`` after
every step; ``python -m toolkit.pipeline_timeline DIR`` draws them.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from adapters._common import loss_name, step_seed
from adapters._torch_pipeline_state import PipelineState
from adapters._torch_stages import cut_model
from toolkit import SGD, Adam, ToolkitError
from toolkit._layouts import Pipeline
from toolkit._partition import PipelineGrid, micro_batch_size
from toolkit._pipeline import lockstep_rounds
from toolkit._schedules import Action, pipeline_schedule
from toolkit._timeline import TIMELINE_ENV, StageRecorder, append_timeline


def check_pipeline(layout: Any, world_size: int) -> PipelineGrid:
    """The rank grid of ``layout`` on ``world_size`` ranks, or a ToolkitError."""
    if not isinstance(layout, Pipeline):
        raise ToolkitError(f"{layout!r} is not a toolkit.Pipeline", "e.g. Pipeline(2, 4)")
    if layout.schedule == "interleaved-1f1b" and layout.stages == 1 and layout.chunks > 1:
        raise ToolkitError("interleaved-1f1b with 1 stage has no neighbour to interleave with",
                           "use 2 or more stages, or chunks=1")
    return PipelineGrid(world_size, layout.stages)


class TorchPipeline(PipelineState):
    """Runs a ``toolkit.Pipeline`` for a ``HorovodTorchAdapter`` (its ``setup`` done), with the
    adapter contract's methods (``build``, ``train_step``, ``evaluate``, ``state_dict``, ...)."""

    def __init__(self, adapter, layout: Pipeline):
        self.adapter, self.layout = adapter, layout
        self.torch, self.hvd, self.env = adapter.torch, adapter.hvd, adapter.env
        self.grid = check_pipeline(layout, self.env.world_size)
        self.stage = self.grid.stage_of(self.env.rank)
        self.replica = self.grid.replica_of(self.env.rank)
        self.schedule = pipeline_schedule(layout.schedule, layout.stages, layout.micro_batches,
                                          layout.chunks)
        self.rounds = lockstep_rounds(self.schedule)
        self.timeline_dir = os.environ.get(TIMELINE_ENV) or None
        self.peak_activations = 0  # most micro-batches whose forward graph was held at once
        self.exchange_seconds: list[float] = []  # the last step's round alltoalls, in order

    @property
    def position(self) -> tuple[int, int]:
        """This rank's (stage, replica)."""
        return self.stage, self.replica

    # ------------------------------------------------------------------------------ build
    def build(self, model: Any, optimizer: Any, loss: Any, *, seed: int = 0,
              accumulation_steps: int = 1, sync_batchnorm: bool = False,
              metrics: Any = None) -> None:
        torch, hvd, a = self.torch, self.hvd, self.adapter
        if accumulation_steps != 1:
            raise ToolkitError(f"accumulation_steps={accumulation_steps} with a pipeline layout",
                               "the pipeline's micro-batches already split each local batch: "
                               "use accumulation_steps=1 and Pipeline(micro_batches=...)")
        if sync_batchnorm:
            raise ToolkitError("sync_batchnorm is not available with a pipeline layout",
                               "use sync_batchnorm=False (each replica keeps its statistics)")
        if not isinstance(optimizer, SGD | Adam):
            raise ToolkitError(f"under a pipeline layout horovod-torch cannot use the optimizer "
                               f"{optimizer!r}", "pass toolkit.SGD(...) or toolkit.Adam(...): "
                               "each stage builds it over its own parameters")
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
        self._plan_reduction()
        self.steps = 0
        self.recorder = StageRecorder(self.stage, self.replica)
        hvd.barrier()  # a common origin for every rank's timeline
        self.recorder.origin = time.time()

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
        self.slots = (("momentum",) if isinstance(spec, SGD) and spec.momentum else
                      ("mu", "nu") if isinstance(spec, Adam) else ())

    def _plan_reduction(self) -> None:
        """Who sends which gradients to whom after the rounds (the same plan on every rank)."""
        grid, names = self.grid, self.cut.names_by_stage
        self.mine = [n for n, *_ in self.params]
        order = list(self.cut.shapes)
        # shared[(s, t)]: the names stages s and t both hold, in the model's order
        self.shared = {(s, t): [n for n in order if n in names[s] and n in names[t]]
                       for s in range(grid.stages) for t in range(grid.stages) if s != t}
        self.reduce = grid.replicas > 1 or any(self.shared.values())

    # ------------------------------------------------------------------------------ messages
    def _exchange(self, outgoing: dict[int, Any], dtype) -> dict[int, Any]:
        """One alltoall over the world: ``outgoing[rank]`` (flat) to each rank; returns what
        each rank sent here (ranks that sent nothing are absent). Every rank must call it."""
        torch = self.torch
        splits = [0] * self.env.world_size
        parts = []
        for r in sorted(outgoing):
            parts.append(outgoing[r].reshape(-1).to(dtype))
            splits[r] = parts[-1].numel()
        buf = torch.cat(parts) if parts else torch.zeros(0, dtype=dtype)
        got, received = self.hvd.alltoall(buf, splits=torch.tensor(splits, dtype=torch.int32))
        sizes = [int(n) for n in received]
        return {r: piece for r, piece in enumerate(got.split(sizes)) if sizes[r]}

    def _pack(self, tensor) -> Any:
        torch = self.torch
        head = torch.tensor([tensor.dim(), *tensor.shape], dtype=self.adapter.dtype)
        return torch.cat([head, tensor.detach().reshape(-1).to(self.adapter.dtype)])

    @staticmethod
    def _unpack(buf, offset: int) -> tuple[Any, int]:
        ndim = int(buf[offset])
        shape = [int(d) for d in buf[offset + 1:offset + 1 + ndim]]
        start = offset + 1 + ndim
        size = int(np.prod(shape))
        return buf[start:start + size].reshape(shape), start + size

    def _pass_messages(self, rnd) -> None:
        rank = self.grid.rank
        out: dict[int, list] = {}
        expected = []
        for sender, receiver, send, recv in rnd.messages:
            if sender == self.stage:
                payload = self.outbox.pop((send.kind, send.micro_batch, send.chunk))
                out.setdefault(rank(receiver, self.replica), []).append(self._pack(payload))
            if receiver == self.stage:
                expected.append((rank(sender, self.replica), recv))
        start = time.time()
        got = self._exchange({r: self.torch.cat(ts) for r, ts in out.items()},
                             self.adapter.dtype)
        end = time.time()
        self.exchange_seconds.append(end - start)
        offsets: dict[int, int] = {}
        for src, recv in expected:
            tensor, offsets[src] = self._unpack(got[src], offsets.get(src, 0))
            key = (recv.micro_batch, recv.chunk)
            if recv.kind == "RECV_F":
                self.inbox_f[key] = tensor.clone().requires_grad_(True)
            else:
                self.inbox_b[key] = tensor.clone()
        for sender, receiver, send, recv in rnd.messages:
            if self.stage in (sender, receiver):
                mine = send if sender == self.stage else recv
                self.recorder.add(mine, start, end, self.steps)

    # ------------------------------------------------------------------------------ steps
    def _compute(self, action: Action) -> None:
        m, c = action.micro_batch, action.chunk
        key, S = (m, c), self.grid.stages
        k = c * S + self.stage
        last = k == S * self.layout.chunks - 1
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
        torch, M = self.torch, self.layout.micro_batches
        micro_batch_size(len(x), M)  # a clear error when M does not divide the local batch
        if lr is not None:
            for group in self.opt.param_groups:
                group["lr"] = lr
        if self.native:
            torch.manual_seed(step_seed(self.seed, self.steps, self.env.rank))
        for piece in self.cut.pieces:
            for module in piece.modules:
                module.train()
        xt, yt = self.adapter._tensors(x, y)
        self.xs, self.ys = xt.chunk(M), yt.chunk(M)
        self.inputs, self.outputs, self.outbox, self.inbox_f, self.inbox_b = {}, {}, {}, {}, {}
        self.loss, self.exchange_seconds = 0.0, []
        self.opt.zero_grad(set_to_none=False)
        first = len(self.recorder.records)
        for rnd in self.rounds:
            action = rnd.compute[self.stage]
            if action is not None:
                with self.recorder.action(action, self.steps):
                    self._compute(action)
            if rnd.messages:
                self._pass_messages(rnd)
        if self.reduce:
            self._reduce_gradients()
        self.opt.step()
        losses = self.hvd.allgather(torch.tensor([self.loss], dtype=torch.float64))
        self.steps += 1
        self.xs = self.ys = None
        if self.timeline_dir:
            self._append_timeline(self.recorder.records[first:])
        return float(losses[self.grid.rank(self.grid.stages - 1, self.replica)])

    def _reduce_gradients(self) -> None:
        """Averages each parameter's gradient over the replicas of its stage (and sums a tied
        parameter's over the stages holding it), every contribution added in rank order."""
        torch, grid = self.torch, self.grid
        grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p))
                 for n, p, _, _ in self.params}
        outgoing = {}
        for r in range(self.env.world_size):
            other = grid.stage_of(r)
            names = self.mine if other == self.stage else self.shared.get((self.stage, other))
            if names:
                outgoing[r] = torch.cat([grads[n].reshape(-1) for n in names])
        got = self._exchange(outgoing, self.adapter.dtype)
        total: dict[str, Any] = {}
        for src in sorted(got):  # rank order: the same sum on every receiving rank
            other = grid.stage_of(src)
            names = self.mine if other == self.stage else self.shared[(other, self.stage)]
            for n, part in zip(names, got[src].split([grads[n].numel() for n in names]),
                               strict=True):
                total[n] = part.clone() if n not in total else total[n] + part
        with torch.no_grad():
            for n, p, _, _ in self.params:
                p.grad = (total[n] / grid.replicas).reshape(p.shape)

    def _append_timeline(self, records: list[dict]) -> None:
        append_timeline(records, self.timeline_dir, self.stage, self.replica)

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
        """Every rank's ``(x, y)`` runs through its replica's pipeline (inputs gathered on the
        first stage, labels on the last); the last stage returns the sums of all of them and
        the other ranks zeros, so the Trainer's sum across ranks is unchanged."""
        torch, grid, a = self.torch, self.grid, self.adapter
        S, V = grid.stages, grid.stages * self.layout.chunks
        f64 = torch.float64
        first, last = grid.rank(0, self.replica), grid.rank(S - 1, self.replica)
        packed_x = self._pack(torch.as_tensor(np.asarray(x, np.float64))).to(f64)
        packed_y = self._pack(torch.as_tensor(np.asarray(y, np.float64))).to(f64)
        outgoing = {first: [packed_x]}
        outgoing.setdefault(last, []).append(packed_y)
        got = self._exchange({r: torch.cat(v) for r, v in outgoing.items()}, f64)
        xs, ys = [], []
        for src in grid.pipeline_ranks(self.replica):
            offset = 0
            if self.env.rank == first:
                part, offset = self._unpack(got[src], offset)
                xs.append(part.numpy())
            if self.env.rank == last:
                ys.append(self._unpack(got[src], offset)[0].numpy())
        for piece in self.cut.pieces:
            for module in piece.modules:
                module.eval()
        h = None
        if xs:
            xt, _ = a._tensors(np.concatenate(xs).astype(x.dtype), np.zeros(0))
            h = xt
        with torch.no_grad():
            for k in range(V):
                if k % S == self.stage:
                    h = self.cut.pieces[k // S].forward(h)
                if k < V - 1 and S > 1:  # hand the activations on to piece k+1's stage
                    src, dst = k % S, (k + 1) % S
                    out = {grid.rank(dst, self.replica): self._pack(h)} if self.stage == src \
                        else {}
                    got = self._exchange(out, a.dtype)
                    if self.stage == dst:
                        h = self._unpack(got[grid.rank(src, self.replica)], 0)[0]
            if self.env.rank != last:
                return {"loss_sum": 0.0, "count": 0.0, "correct": 0.0,
                        **dict.fromkeys(a.metrics, 0.0)}
            _, yt = a._tensors(np.zeros(0), np.concatenate(ys).astype(y.dtype))
            return self._sums(h, yt)

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
