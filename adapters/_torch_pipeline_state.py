"""The torch side of ``_torch_pipeline.TorchPipeline``'s state: this rank's tensors under the
full model's neutral names, loading a full state, and the bytes each stage holds.

Gathering (``state_dict``), checkpoint pieces (``sharded_state``) and replica-0 buffers
(``sync_state``) are the Horovod executors' shared part (``adapters/_hvd_pipeline.py``): a
tensor's *owner* is replica 0 of the first stage that holds it (a tied ``tok_emb``: stage 0).
"""

from __future__ import annotations

import numpy as np

from adapters._torch_models import same, to_host

# Neutral optimizer-state names (the checkpoint format's) <-> torch.optim state keys.
_SLOTS = {"momentum": "momentum_buffer", "mu": "exp_avg", "nu": "exp_avg_sq"}


class PipelineState:
    """Mixed into ``TorchPipeline`` (which sets ``cut``, ``params``, ``opt``, ``slots``...)."""

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

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds between steps: its stage's parameters, a gradient of each,
        and their optimizer slots (a tied parameter counts on both stages that hold it)."""
        params = sum(p.nbytes for _, p, _, _ in self.params)
        slots = sum(v.nbytes for p in (e[1] for e in self.params)
                    for v in self.opt.state[p].values() if self.torch.is_tensor(v) and v.dim())
        return {"params": params, "grads": params, "optimizer": slots}
