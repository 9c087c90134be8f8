"""Data parallelism for ``horovod-tf``: every rank holds the whole model and optimizer; the
step (forward, backward, gradient allreduce, update) is one ``tf.function``.

Two kinds of model:

- a spec (``toolkit.MLP``/``CNN``/``GPT``): ``tf.Variable``\\ s under the spec's neutral names,
  built from its numpy initialisation; with a spec optimizer the arithmetic is torch.optim's
  in TF ops (see ``toolkit.models.reference``), so the backends agree to rounding.
- any built Keras 3 model (Sequential, functional or subclassed), called as
  ``model(x, training=True)`` in steps and ``training=False`` in evaluation. All of its state
  is the backend's: trainable variables (``params/...``), non-trainable ones such as
  BatchNormalization's moving statistics (``buffers/...``, broadcast from rank 0 at build and
  by ``sync_state`` unless ``sync_batchnorm`` computes the statistics over the global batch),
  the optimizer's variables (``opt/...``) and the step its randomness derives from
  (``rng/step``); see ``models/keras_native.py`` for the names and the seeding of Dropout.

Optimizers: ``toolkit.SGD``/``Adam`` (any model) or a Keras 3 optimizer (Keras models only,
with its own learning rate or schedule: the Trainer passes ``lr=None``).

``sharded.py`` subclasses this strategy and replaces the hooks marked below.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from adapters._backend import StrategyBase
from adapters._common import check_recompute, unwrapped_toolkit_errors
from adapters._update import UpdateRule
from adapters.horovod_tf.models.keras_native import KerasNative
from adapters.horovod_tf.models.spec import spec_forward
from adapters.horovod_tf.ops import TFOps, TFState
from adapters.horovod_tf.precision import TFPrecision
from adapters.horovod_tf.update import apply_update, step_scalars, sum_squares, update
from toolkit.contract import StepResult
from toolkit.precision import PRECISIONS


class TFDataParallel(StrategyBase):
    """``toolkit.DataParallel`` for ``horovod-tf`` (see :class:`toolkit.Adapter`)."""

    clips = True  # build takes clip_grad_norm; the StepResult then has grad_norm
    skips = True  # build takes skip_nonfinite; the StepResult then says skipped
    compresses = True  # the runtime's compression goes to each gradient's allreduce
    # mixed: the spec model's forward on its variables and inputs cast to the compute dtype
    # (TFOps.in_compute), each product rounded once (models/layers.matmul), the loss in float32
    precisions = PRECISIONS
    plugin = TFPrecision  # (adapters/_precision.py)
    recomputes = True  # activation_checkpointing: tf.recompute_grad in the spec forward
    defers = True  # the step advances the update's counters itself (adapters/_update.py)

    def __init__(self, runtime, layout, precision: Any = None):
        super().__init__(runtime, layout, precision)
        self.tf, self.hvd, self.dtype = runtime.tf, runtime.hvd, runtime.dtype

    # -------------------------------------------------------------------------- build
    def build(self, model: Any, optimizer: Any, loss: Any, *, seed: int = 0,
              accumulation_steps: int = 1, sync_batchnorm: bool = False,
              metrics: Any = None, clip_grad_norm: float | None = None,
              skip_nonfinite: bool = False, activation_checkpointing: bool | None = None) -> None:
        tf = self.tf
        self.recompute = check_recompute("horovod-tf", model, activation_checkpointing)
        self.rule = UpdateRule(optimizer, clip_grad_norm, skip_nonfinite, self.precision.scaler,
                               defer=self.defers)
        self.ops = TFOps(self.runtime, model, loss, metrics)
        self.spec, self.native = model, self.ops.native
        self.accumulation_steps, self.seed = accumulation_steps, seed
        self.sync_batchnorm = sync_batchnorm and self.native
        self.keras_model: KerasNative | None = None
        self.state = TFState(tf, self.native, self.rule)
        self._make_variables(model, optimizer, seed)
        self._step = tf.function(self._step_fn, reduce_retracing=True)
        self._no_seeds = tf.zeros((0, 2), tf.int64)
        self._eval = tf.function(self._eval_fn, reduce_retracing=True)

    def _make_variables(self, model: Any, optimizer: Any, seed: int) -> None:
        """(hook) The variables and optimizer slots, rank 0's on every rank."""
        tf, state = self.tf, self.state
        if self.native:
            self.keras_model = KerasNative(model, self.runtime.dtype_name, "horovod-tf",
                                           self.precision)
            if self.sync_batchnorm:
                from adapters.horovod_tf.models.keras_sync_bn import convert_sync_batchnorm

                convert_sync_batchnorm(self.keras_model.keras, tf, self.hvd, model)
            state.vars, state.buffers = self.keras_model.params, self.keras_model.buffers
        else:
            state.vars = {n: tf.Variable(v, name=n.replace(".", "_"))
                          for n, v in model.init(seed, self.runtime.dtype_name).items()}
        state.build_optimizer(model, optimizer, self.keras_model)
        state.broadcast(self.hvd)

    # -------------------------------------------------------------------------- math
    def _forward(self, x, training: bool):
        """(hook) The model's outputs."""
        if self.native:
            return self.keras_model.model(x, training=training)
        cast = self.precision.in_compute
        return spec_forward(self.tf, self.spec, cast(self.state.vars), cast(x),
                            self.recompute and training)

    def local_grads(self, x, y, variables, scale=None):
        """This rank's gradients w.r.t. ``variables``, summed over the micro-batches, and its
        mean loss (each micro-batch's mean divided by their number); under loss scaling the
        gradients are those of the loss times ``scale``."""
        tf, k = self.tf, self.accumulation_steps
        grads = [tf.zeros_like(v) for v in variables]
        total = tf.constant(0.0, self.dtype)
        for xc, yc in zip(tf.split(x, k), tf.split(y, k), strict=True):
            with tf.GradientTape() as tape:
                losses = self.ops.per_sample_loss(self._forward(xc, training=True), yc)
                loss = tf.cast(tf.reduce_mean(losses), self.dtype) / k
                target = self.precision.scale_loss(loss, scale)
            new = tape.gradient(target, variables)
            grads = [a if b is None else a + tf.convert_to_tensor(b)
                     for a, b in zip(grads, new, strict=True)]
            total += loss
        return grads, total

    def _step_fn(self, x, y, scalars, seeds):
        """(hook) One compiled step."""
        s = step_scalars(self.tf, scalars)  # (one host copy per step)
        tf, hvd, state = self.tf, self.hvd, self.state
        if self.native:
            self.keras_model.reseed(seeds)
        names = state.names
        variables = [state.vars[n] for n in names]
        kept = ([(b, tf.identity(b)) for b in state.buffers.values()]
                if self.rule.skip else [])
        scale = self.precision.step_scale(s)
        grads, total = self.local_grads(x, y, variables, scale)
        compression = self.runtime.compressor()
        grads = [hvd.allreduce(g, op=hvd.Average, name=f"grad_{i}", compression=compression)
                 for i, g in enumerate(grads)]

        def apply(grads: list) -> None:
            if state.keras_opt is not None:
                state.keras_opt.apply_gradients(zip(grads, variables, strict=True))
            else:
                apply_update(tf, self.rule.spec, state.vars, state.slots,
                             dict(zip(names, grads, strict=True)), s)

        _, norm = update(tf, self.rule, grads, lambda g: sum_squares(tf, g), apply, kept,
                         scalars)
        return total, norm

    def _eval_fn(self, x, y):
        return self.ops.eval_sums(self._forward(x, training=False), y)

    # -------------------------------------------------------------------------- steps
    def train_step(self, x: np.ndarray, y: np.ndarray, lr: float | None) -> StepResult:
        """One step; ``lr`` is ignored with a Keras optimizer (its own rate or schedule)."""
        scalars = self.state.scalars(lr, self.dtype)
        seeds = (self.keras_model.seeds(self.seed, self.state.steps, self.env.rank)
                 if self.native else self._no_seeds)
        with unwrapped_toolkit_errors():
            loss, norm = self._step(*self.ops.inputs(x, y), scalars, seeds)
        self.state.steps += 1
        # the loss a scalar tensor: the Trainer converts it when it averages losses; the norm
        # read on the host only under skip_nonfinite (a skipped step is no optimizer step)
        return self.rule.result(loss, norm)

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
        with unwrapped_toolkit_errors():
            return self.ops.result(self._eval(*self.ops.inputs(x, y)), len(x))

    def sync_state(self) -> None:
        """Rank 0's non-trainable variables (BatchNorm statistics) become every rank's."""
        if self.env.world_size > 1 and self.state.buffers and not self.sync_batchnorm:
            for var in self.state.buffers.values():
                var.assign(self.hvd.broadcast(self.tf.convert_to_tensor(var), root_rank=0))

    # -------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, np.ndarray]:
        return self.state.state()

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        self.state.load(state)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of the parameters, gradients and optimizer state this rank holds: every
        parameter, a gradient as large, every slot."""
        return self.state.memory_bytes()
