"""``toolkit.DataParallel`` for ``jax-pjit``."""

from __future__ import annotations

import math
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


class PjitDataParallel(JaxStrategy):
    """``toolkit.DataParallel`` for ``jax-pjit``: one program over a ``data`` mesh axis."""

    # mixed: the parameters cast inside the one program; its gradient is the global batch's,
    # its partial sums reduced before they are rounded (data_split)
    precisions = PRECISIONS
    recomputes = True  # activation_checkpointing: nn.remat in the spec models

    @property
    def data_split(self) -> tuple[int, int]:
        """One program over the global batch: the rounded arithmetic of one batch, whatever
        the devices (the compiler adds the devices' partial products before rounding)."""
        return 1, 1

    def build(self, model: Any, optimizer: Any, loss: Any, *, seed: int = 0,
              accumulation_steps: int = 1, sync_batchnorm: bool = False,
              metrics: Any = None, clip_grad_norm: float | None = None,
              skip_nonfinite: bool = False, activation_checkpointing: bool | None = None) -> None:
        self._compiled_for = None  # the step compiles anew for this model
        self.rule = UpdateRule(optimizer, clip_grad_norm, skip_nonfinite, self.precision.scaler,
                               defer=self.defers)
        self.recompute = check_recompute(self.name, model, activation_checkpointing)
        self._build_layout(model, optimizer, loss, seed, accumulation_steps, metrics)

    def _build_layout(self, model, optimizer, loss, seed, accumulation_steps, metrics) -> None:
        """(hook) The replicated state over a data mesh, and the jitted step."""
        jax = self.jax
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        params, opt_state, model_state = self._build_common(model, optimizer, loss, seed,
                                                            accumulation_steps, metrics)
        self.mesh = Mesh(np.asarray(jax.devices()), ("data",))
        self.replicated = NamedSharding(self.mesh, PartitionSpec())
        self.batch = NamedSharding(self.mesh, PartitionSpec("data"))
        self.params = self._replicate(params)
        self.opt_state = self._replicate(opt_state)
        self.model_state = self._replicate(model_state)
        repl, batch = self.replicated, self.batch
        self._jstep = jax.jit(self._global_step,
                              in_shardings=(repl, repl, repl, batch, batch, repl, repl),
                              out_shardings=(repl, repl, repl, batch, repl),
                              donate_argnums=(0, 1, 2))
        # Evaluation shares may be uneven across ranks, so each rank evaluates its own samples
        # on its first local device with the (replicated) parameters.
        self._jeval = jax.jit(self._eval_fn)

    def _replicate(self, tree):
        jax = self.jax
        return jax.tree_util.tree_map(
            lambda a: jax.make_array_from_process_local_data(self.replicated, np.asarray(a)),
            tree)

    def _global_step(self, params, opt_state, model_state, x, y, scalars, seed):
        # One program over the global batch: BatchNorm statistics span every rank's samples
        # (synchronised by construction) and dropout masks do not depend on the world size.
        key = self.jax.random.PRNGKey(seed)
        jnp, before = self.jnp, (params, opt_state, model_state)
        scale = self.loss_scale(scalars)
        grads, losses, new_state = self._accumulated_grads(params, model_state, x, y, key,
                                                           scale=scale)
        (params, opt_state, model_state), norm = update(
            jnp, self.rule, grads, lambda g: squares(jnp, g),
            lambda g: (*apply_optimizer(self.rule, self.tx, g, opt_state, params, scalars),
                       new_state),
            before, scalars)
        return params, opt_state, model_state, losses, norm

    batch_axes: tuple[str, ...] = ("data",)  # the mesh axes the batch is split over

    def _local_rows(self) -> int:
        """The batch-axis coordinates among this process's devices (its data rows): all its
        devices under data parallelism, fewer when a ``model`` axis groups them, and one when
        that group spans several processes, which then feed the same samples."""
        me, mesh = self.jax.process_index(), self.mesh
        axes = [mesh.axis_names.index(a) for a in self.batch_axes]
        return len({tuple(i[a] for a in axes) for i, d in np.ndenumerate(mesh.devices)
                    if d.process_index == me})

    def _global(self, local: np.ndarray, local_rows: int):
        # The global shape stated, not inferred: processes that share data rows pass the same
        # samples, and the array holds each row once.
        rows = math.prod(self.mesh.shape[a] for a in self.batch_axes)
        shape = (len(local) * rows // local_rows, *local.shape[1:])
        return self.jax.make_array_from_process_local_data(self.batch, local, shape)

    def device_batch(self, x: np.ndarray, y: np.ndarray):
        """The local batch as this step's global arrays (``toolkit.contract.PlacesBatches``);
        made in the Trainer's prefetch thread, so the copy overlaps the running step."""
        rows = self._local_rows()
        if len(x) % (rows * self.accumulation_steps):
            where = (f"{rows} local devices" if rows == self.jax.local_device_count() else
                     f"this process's {rows} data shard(s) (a model axis groups its devices)")
            raise ToolkitError(
                f"jax-pjit: the local batch of {len(x)} samples does not split over {where} "
                f"x {self.accumulation_steps} accumulation steps",
                f"use a global batch divisible by world size x "
                f"{rows * self.accumulation_steps}, or change --local-devices")
        return self._global(self.inputs(x), rows), self._global(self.labels(y), rows)

    def train_step(self, x: np.ndarray, y: np.ndarray, lr: float | None) -> StepResult:
        if not (isinstance(x, self.jax.Array) and x.sharding == self.batch):
            x, y = self.device_batch(x, y)
        # The step's scalars go in as numpy arrays: jit copies them to its replicated sharding
        # itself, ~10 us against ~200 us per make_array_from_process_local_data (measured).
        # Numpy inputs to a multi-process jit are taken as replicated: every process passes the
        # same values (the Trainer's learning rate, a seed from the step count).
        out = self._run_step(self._jstep, (self.params, self.opt_state, self.model_state, x, y,
                                           self.optimizer_scalars(lr), self._step_seed()))
        self.params, self.opt_state, self.model_state, losses = out[:4]
        self._keep(out)
        # Per-sample losses stay sharded like the batch: this process's shards are its samples,
        # each once (a shard is on every device of its data row's ``model`` group).
        shards = {(s.index[0].start, s.index[0].stop): s.data for s in losses.addressable_shards}
        # the norm is replicated: float() reads this process's copy
        return self.rule.result(LocalMean(list(shards.values())), out[-1])

    def _keep(self, out) -> None:
        """(hook) What a layout keeps of the step's outputs beyond the state."""

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
        params = self._full_params()
        sums = self._jeval(params, self._host(self.model_state), self.inputs(x),
                           self.labels(y))
        return self._eval_result(sums, len(x))

    def _host(self, tree):
        return self.jax.tree_util.tree_map(lambda a: np.asarray(a.addressable_data(0)), tree)

    def _full_params(self):
        """(hook) Every parameter, whole, on the host."""
        return self._host(self.params)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of this process's device buffers (a replicated buffer once per local device):
        parameters, a gradient as large (the step's own: data parallel keeps none between
        steps), optimizer slots."""
        params = nbytes(self.params)
        return {"params": params, "grads": params, "optimizer": nbytes(self.opt_state)}

    def state_dict(self) -> dict[str, np.ndarray]:
        return self._export(self._host(self.params), self._host(self.opt_state),
                            self._host(self.model_state))

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        params, opt_state, model_state = self._import(
            state, self._host(self.params), self._host(self.opt_state),
            self._host(self.model_state))
        self.params, self.opt_state = self._replicate(params), self._replicate(opt_state)
        self.model_state = self._replicate(model_state)
