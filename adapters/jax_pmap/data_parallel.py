"""``toolkit.DataParallel`` for ``jax-pmap``."""

from __future__ import annotations

from typing import Any

import numpy as np

from adapters._common import check_recompute
from adapters._jax.flat_units import nbytes
from adapters._jax.strategy import JaxStrategy, LocalMean
from adapters._jax.update import apply_optimizer, squares, update
from adapters._update import UpdateRule
from toolkit import ToolkitError
from toolkit.contract import StepResult
from toolkit.precision import PRECISIONS


class PmapDataParallel(JaxStrategy):
    """``toolkit.DataParallel`` for ``jax-pmap``: a replica per local device."""

    # bf16-mixed: each device casts its replica to bfloat16 inside the step, and its gradient
    # (float32 again through the cast) is averaged in float32
    precisions = PRECISIONS
    recomputes = True  # activation_checkpointing: nn.remat in the spec models

    def build(self, model: Any, optimizer: Any, loss: Any, *, seed: int = 0,
              accumulation_steps: int = 1, sync_batchnorm: bool = False,
              metrics: Any = None, clip_grad_norm: float | None = None,
              skip_nonfinite: bool = False, activation_checkpointing: bool | None = None) -> None:
        self._compiled_for = None  # the step compiles anew for this model
        self.rule = UpdateRule(optimizer, clip_grad_norm, skip_nonfinite, self.precision.scaler,
                               defer=self.defers)
        self.recompute = check_recompute(self.name, model, activation_checkpointing)
        jax = self.jax
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        self.devices = jax.local_devices()
        # One copy (or shard) per local device, stacked on a leading axis (what pmap maps over).
        self.stacked = NamedSharding(Mesh(np.asarray(self.devices), ("local",)),
                                     PartitionSpec("local"))
        self._build_layout(model, optimizer, loss, seed, accumulation_steps, metrics)

    def _build_layout(self, model, optimizer, loss, seed, accumulation_steps, metrics) -> None:
        """(hook) The replicated state and the pmapped step."""
        jax = self.jax
        params, opt_state, model_state = self._build_common(model, optimizer, loss, seed,
                                                            accumulation_steps, metrics)
        self.params, self.opt_state = self._replicate(params), self._replicate(opt_state)
        self.model_state = self._replicate(model_state)
        self._pstep = jax.pmap(self._device_step, axis_name="batch",
                               in_axes=(0, 0, 0, 0, 0, self._unmapped_scalars(), None),
                               donate_argnums=(0, 1, 2))
        self._jeval = jax.jit(self._eval_fn)

    def _device_step(self, params, opt_state, model_state, x, y, scalars, seed):
        lax = self.jax.lax
        # Each device draws its own dropout masks: the key folds in the device's index.
        key = self.jax.random.fold_in(self.jax.random.PRNGKey(seed), lax.axis_index("batch"))
        jnp, before = self.jnp, (params, opt_state, model_state)
        scale = self.loss_scale(scalars)
        grads, losses, new_state = self._accumulated_grads(params, model_state, x, y, key,
                                                           scale=scale)
        grads = lax.pmean(grads, axis_name="batch")
        # BatchNorm statistics are averaged over every device (of every process) each step, so
        # the replicas never drift apart (a module built with axis_name="batch" syncs them in
        # the forward pass already; then this changes nothing).
        new_state = lax.pmean(new_state, axis_name="batch")
        (params, opt_state, model_state), norm = update(
            jnp, self.rule, grads, lambda g: squares(jnp, g),
            lambda g: (*apply_optimizer(self.rule, self.tx, g, opt_state, params, scalars),
                       new_state),
            before, scalars)
        return params, opt_state, model_state, jnp.mean(losses), norm

    def train_step(self, x: np.ndarray, y: np.ndarray, lr: float | None) -> StepResult:
        # (No device_batch here, unlike jax-pjit: copying the batch to the devices in the
        # prefetch thread measured no faster than pmap copying numpy inputs itself, within
        # the 2% the benchmark moves between runs.)
        d, k = len(self.devices), self.accumulation_steps
        if len(x) % (d * k):
            raise ToolkitError(
                f"jax-pmap: the local batch of {len(x)} samples does not split over {d} local "
                f"devices x {k} accumulation steps",
                f"use a global batch divisible by world size x {d * k}, or change "
                "--local-devices / --accumulation-steps")
        xs = self.inputs(x).reshape((d, -1) + x.shape[1:])
        ys = self.labels(y).reshape((d, -1) + y.shape[1:])
        args = (self.params, self.opt_state, self.model_state, xs, ys,
                self.optimizer_scalars(lr), self._step_seed())
        out = self._run_step(self._pstep, args, ahead=False)
        self.params, self.opt_state, self.model_state, losses = out[:4]
        self._keep(out)
        # a mean per device; the norm is the same on every device
        return self.rule.result(LocalMean([losses]), out[-1], stacked=True)

    def _keep(self, out) -> None:
        """(hook) What a layout keeps of the step's outputs beyond the state."""

    def _replicate(self, tree):
        d = len(self.devices)
        return self.jax.tree_util.tree_map(
            lambda a: self.jax.device_put(np.stack([np.asarray(a)] * d), self.stacked), tree)

    def _local(self, tree):
        return self.jax.tree_util.tree_map(lambda a: np.asarray(a[0]), tree)

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
        params = self._full_params()
        sums = self._jeval(params, self._local(self.model_state), self.inputs(x),
                           self.labels(y))
        return self._eval_result(sums, len(x))

    def _full_params(self):
        """(hook) Every parameter, whole, on the host."""
        return self._local(self.params)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of this process's device buffers (every local device's replica): parameters,
        a gradient as large (the step's own: data parallel keeps none between steps),
        optimizer slots."""
        params = nbytes(self.params)
        return {"params": params, "grads": params, "optimizer": nbytes(self.opt_state)}

    def state_dict(self) -> dict[str, np.ndarray]:
        return self._export(self._local(self.params), self._local(self.opt_state),
                            self._local(self.model_state))

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        params, opt_state, model_state = self._import(
            state, self._local(self.params), self._local(self.opt_state),
            self._local(self.model_state))
        self.params, self.opt_state = self._replicate(params), self._replicate(opt_state)
        self.model_state = self._replicate(model_state)
