"""The state side of ``_torch_pipeline.TorchPipeline``: full tensors under neutral names on
every rank, checkpoint pieces, and the bytes each stage holds.

A tensor's *owner* is replica 0 of the first stage that holds it (a tied ``tok_emb``: stage 0).
``state_dict`` gathers every owner's tensors with one ``hvd.allgather`` of a float64 buffer
(lossless for float32, float64 and integer counters), so every rank returns the whole model;
``sharded_state`` gives the checkpoint store one flat piece per tensor from its owner and an
empty piece of the same dtype from every other rank (the store concatenates them in rank
order), so a pipeline checkpoint loads in any layout, and any checkpoint in a pipeline.
"""

from __future__ import annotations

import numpy as np

from adapters._torch_models import same, to_host

# Neutral optimizer-state names (the checkpoint format's) <-> torch.optim state keys.
_SLOTS = {"momentum": "momentum_buffer", "mu": "exp_avg", "nu": "exp_avg_sq"}


class PipelineState:
    """Mixed into ``TorchPipeline`` (which sets ``cut``, ``params``, ``opt``, ``slots``...)."""

    def _catalogue(self) -> list[tuple[str, tuple[int, ...], np.dtype, int]]:
        """Every tensor of the full model's state: (key, shape, dtype, owner rank)."""
        grid, names = self.grid, self.cut.names_by_stage
        dtype = np.dtype(self.adapter.dtype_name)
        out = []
        for n, shape in self.cut.shapes.items():
            owner = grid.rank(min(s for s in range(grid.stages) if n in names[s]), 0)
            out.append((f"params/{n}", shape, dtype, owner))
            out += [(f"opt/{slot}/{n}", shape, dtype, owner) for slot in self.slots]
        for n, (stage, shape, buf_dtype) in self.cut.buffer_specs.items():
            out.append((f"buffers/{n}", shape, buf_dtype, grid.rank(stage, 0)))
        return out

    def _local(self) -> dict[str, np.ndarray]:
        """This rank's tensors under their neutral keys (each stage's, on every replica)."""
        out = {}
        for n, p, _, from_torch in self.params:
            out[f"params/{n}"] = to_host(p, from_torch)
            for slot in self.slots:
                out[f"opt/{slot}/{n}"] = to_host(self.opt.state[p][_SLOTS[slot]], from_torch)
        for n, b in self.cut.buffers:
            out[f"buffers/{n}"] = to_host(b, same)
        return out

    def _replicated(self) -> dict[str, np.ndarray]:
        out = {}
        if "mu" in self.slots:
            step = self.opt.state[self.params[0][1]]["step"]
            out["opt/count"] = np.asarray(int(step), np.int64)
        if self.native:
            out["rng/step"] = np.asarray(self.steps, np.int64)
        return out

    def state_dict(self) -> dict[str, np.ndarray]:
        """The whole model and optimizer state, on every rank (a collective)."""
        torch, rank = self.torch, self.env.rank
        catalogue, local = self._catalogue(), self._local()
        mine = [local[key].reshape(-1).astype(np.float64)
                for key, _, _, owner in catalogue if owner == rank]
        flat = np.concatenate(mine) if mine else np.zeros(0)
        everything = self.hvd.allgather(torch.from_numpy(flat)).numpy()
        out, offset = {}, 0
        for owner in range(self.env.world_size):  # allgather concatenates in rank order
            for key, shape, dtype, who in catalogue:
                if who == owner:
                    size = int(np.prod(shape))
                    out[key] = everything[offset:offset + size].reshape(shape).astype(dtype)
                    offset += size
        return {**out, **self._replicated()}

    def sharded_state(self):
        """``(replicated, pieces)`` for ``CheckpointStore.save(..., shards=pieces)``: each
        tensor whole from its owner, an empty piece from every other rank."""
        local, rank = self._local(), self.env.rank
        pieces = {key: (local[key].reshape(-1) if owner == rank else np.zeros(0, dtype), 0,
                        shape) for key, shape, dtype, owner in self._catalogue()}
        return self._replicated(), pieces

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """Keeps this stage's part of the full ``state``."""
        torch, dtype = self.torch, self.adapter.dtype

        def tensor(a, to_torch, dt=dtype):  # a copy: never alias the caller's array
            return torch.tensor(np.asarray(to_torch(np.asarray(a))), dtype=dt)

        with torch.no_grad():
            for n, p, to_torch, _ in self.params:
                p.copy_(tensor(state[f"params/{n}"], to_torch))
                slots = self.opt.state[p]
                for slot in self.slots:
                    slots[_SLOTS[slot]] = tensor(state[f"opt/{slot}/{n}"], to_torch)
                if "step" in slots:
                    slots["step"] = torch.tensor(float(state["opt/count"]))
            for n, b in self.cut.buffers:
                b.copy_(tensor(state[f"buffers/{n}"], same, b.dtype))
        if self.native:
            self.steps = int(state["rng/step"])

    def sync_state(self) -> None:
        """Replica 0's buffers (BatchNorm statistics) of each stage become its replicas'."""
        if self.grid.replicas == 1 or not self.cut.buffer_specs:
            return
        torch, grid = self.torch, self.grid
        flat = [b.detach().reshape(-1).to(torch.float64) for _, b in self.cut.buffers]
        outgoing = {}
        if self.replica == 0 and flat:
            outgoing = {r: torch.cat(flat) for r in grid.stage_ranks(self.stage)[1:]}
        got = self._exchange(outgoing, torch.float64)
        if self.replica and flat:
            parts = got[grid.rank(self.stage, 0)].split([f.numel() for f in flat])
            with torch.no_grad():
                for (_, b), part in zip(self.cut.buffers, parts, strict=True):
                    b.copy_(part.reshape(b.shape).to(b.dtype))

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds between steps: its stage's parameters, a gradient of each,
        and their optimizer slots (a tied parameter counts on both stages that hold it)."""
        params = sum(p.nbytes for _, p, _, _ in self.params)
        slots = sum(v.nbytes for p in (e[1] for e in self.params)
                    for v in self.opt.state[p].values() if self.torch.is_tensor(v) and v.dim())
        return {"params": params, "grads": params, "optimizer": slots}
