"""The ``horovod-tf`` backend: TensorFlow 2 with Horovod's core TensorFlow ops.

Built on ``horovod.tensorflow`` (allreduce/broadcast ops) and ``tf.GradientTape``, not on
``horovod.tensorflow.keras``, which targets Keras 2 and breaks with Keras 3. The step (forward,
backward, gradient allreduce, update) is one ``tf.function``.

Two kinds of model:

- a spec (``toolkit.MLP``/``CNN``/``GPT``): ``tf.Variable``\\ s under the spec's neutral names,
  built from its numpy initialisation; with a spec optimizer the arithmetic is torch.optim's
  in TF ops (see ``toolkit._reference``), so the backends agree to rounding.
- any built Keras 3 model (Sequential, functional or subclassed), called as
  ``model(x, training=True)`` in steps and ``training=False`` in evaluation. All of its state
  is the backend's: trainable variables (``params/...``), non-trainable ones such as
  BatchNormalization's moving statistics (``buffers/...``, broadcast from rank 0 at build and
  by ``sync_state`` unless ``sync_batchnorm`` computes the statistics over the global batch),
  the optimizer's variables (``opt/...``) and the step its randomness derives from
  (``rng/step``); see ``adapters._keras_native`` for the names and the seeding of Dropout.

Optimizers: ``toolkit.SGD``/``Adam`` (any model) or a Keras 3 optimizer (Keras models only,
with its own learning rate or schedule: the Trainer passes ``lr=None``).

Layouts: data parallel; ``toolkit.Sharded(stage=1|2|3)`` (ZeRO / FSDP) for the spec models
and optimizers, whose mechanism lives in ``adapters._tf_sharded``; ``toolkit.Pipeline`` (spec
models or a Keras ``Sequential``, spec optimizers), run by ``adapters._tf_pipeline`` to which
the contract's methods below delegate.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from adapters._common import (
    BackendBase,
    check_per_sample,
    check_world,
    loss_name,
    missing_framework,
    unwrapped_toolkit_errors,
)
from adapters._hvd_layout import HvdPipelineAbility
from adapters._keras_native import KerasNative, assign, is_keras_optimizer, to_host
from adapters._tf_update import apply_update
from toolkit import CNN, GPT, SGD, Adam, LaunchEnv, ToolkitError
from toolkit._reference import adam_scalars, optimizer_slots
from toolkit._specs import ModelSpec, check_choice


class HorovodTFAdapter(HvdPipelineAbility, BackendBase):
    """TensorFlow + Horovod. See :class:`toolkit.Adapter` for the contract."""

    name = "horovod-tf"
    _layout = None  # a toolkit.Sharded layout from set_layout, or None (data parallel)
    sharded = None  # its state (adapters._tf_sharded.ShardedTF) once built
    executor = "adapters._tf_pipeline:TFPipeline"  # under a toolkit.Pipeline

    def _take_layout(self, layout: Any) -> None:
        """Shards (``toolkit.Sharded``) or cuts into stages (``toolkit.Pipeline``) what
        ``build`` creates, as ``layout`` says."""
        from adapters._tf_sharded import check_layout

        if not self._set_pipeline(layout):
            self._layout = check_layout(self.name, layout)

    def _connect(self, env: LaunchEnv) -> None:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        try:
            import tensorflow as tf
        except ImportError as err:
            raise missing_framework(self.name, "TensorFlow", err) from err
        try:
            import horovod.tensorflow as hvd
        except ImportError as err:
            raise missing_framework(self.name, "Horovod built with TensorFlow support",
                                    err) from err
        self.tf, self.hvd, self.env = tf, hvd, env
        threads = max(1, (os.cpu_count() or 1) // env.local_size)
        try:  # only possible before TF's runtime starts (once per process)
            tf.config.threading.set_intra_op_parallelism_threads(threads)
            tf.config.threading.set_inter_op_parallelism_threads(1)
        except RuntimeError:
            pass
        self._init_horovod(hvd, env)
        check_world(self.name, env, hvd.size(), hvd.rank())
        self.dtype = {"float32": tf.float32, "float64": tf.float64}[self.dtype_name]

    # -------------------------------------------------------------------------- build
    def build(self, model: Any, optimizer: Any, loss: Any, *, seed: int = 0,
              accumulation_steps: int = 1, sync_batchnorm: bool = False,
              metrics: Any = None) -> None:
        if self.pipeline is not None:
            return self.pipeline.build(model, optimizer, loss, seed=seed, metrics=metrics,
                                       accumulation_steps=accumulation_steps,
                                       sync_batchnorm=sync_batchnorm)
        tf = self.tf
        if self._layout is not None:
            from adapters._tf_sharded import check_shardable

            check_shardable(self.name, self._layout, model, optimizer)
        self.loss_name, self.loss_fn = loss_name(loss), loss
        self.metrics = dict(metrics or {})
        self.accumulation_steps, self.seed = accumulation_steps, seed
        self.native = not isinstance(model, ModelSpec)
        self.sync_batchnorm = sync_batchnorm and self.native
        self.keras_model: KerasNative | None = None
        self.is_gpt = False
        self.buffers: dict[str, Any] = {}
        self.sharded = None
        if self._layout is not None:  # a spec model and optimizer (check_shardable)
            from adapters._tf_sharded import ShardedTF

            self.spec, self.is_gpt = model, isinstance(model, GPT)
            self.opt_spec, self.keras_opt, self.slots = optimizer, None, {}
            self.sharded = ShardedTF(self, self._layout, model, optimizer,
                                     model.init(seed, self.dtype_name))
        elif self.native:
            self.keras_model = KerasNative(model, self.dtype_name, self.name)
            if self.sync_batchnorm:
                from adapters._keras_sync_bn import convert_sync_batchnorm

                convert_sync_batchnorm(self.keras_model.keras, tf, self.hvd, model)
            self.vars, self.buffers = self.keras_model.params, self.keras_model.buffers
        else:
            self.spec = model
            self.is_gpt = isinstance(model, GPT)
            self.vars = {n: tf.Variable(v, name=n.replace(".", "_"))
                         for n, v in model.init(seed, self.dtype_name).items()}
        if self.sharded is None:
            self.names = list(self.vars)
            self._build_optimizer(model, optimizer)
        self.count = 0  # spec optimizer steps taken (Adam's t), kept on the host
        self.steps = 0  # steps taken: a native model's randomness of the next one derives from it
        if self.sharded is None:
            self._broadcast_state()  # (the sharded state broadcasts rank 0's parameters itself)
        self._step = tf.function(self._step_fn if self.sharded is None else
                                 self.sharded.step_fn, reduce_retracing=True)
        self._no_seeds = tf.zeros((0, 2), tf.int64)
        self._eval = tf.function(self._eval_fn, reduce_retracing=True)

    def _build_optimizer(self, model: Any, optimizer: Any) -> None:
        tf = self.tf
        self.opt_spec, self.keras_opt = None, None
        self.slots: dict[str, Any] = {}
        if isinstance(optimizer, SGD | Adam):
            self.opt_spec = optimizer
            self.slots = {f"opt/{slot}/{n}": tf.Variable(tf.zeros_like(v))
                          for slot in optimizer_slots(optimizer) for n, v in self.vars.items()}
        elif self.native and is_keras_optimizer(optimizer):
            self.keras_opt = optimizer
            self.slots = self.keras_model.build_optimizer(optimizer, self.name)
        elif is_keras_optimizer(optimizer):
            raise ToolkitError("a Keras optimizer needs a Keras model; this model is a "
                               f"{type(model).__name__} spec",
                               "pass toolkit.SGD(...)/toolkit.Adam(...) with a spec")
        else:
            raise ToolkitError(f"horovod-tf cannot build an optimizer from {optimizer!r}",
                               "pass toolkit.SGD(...)/toolkit.Adam(...) or a Keras 3 optimizer "
                               "(keras.optimizers.SGD/Adam/AdamW)")

    def _broadcast_state(self) -> None:
        hvd, tf = self.hvd, self.tf
        for var in [*self.vars.values(), *self.buffers.values(), *self.slots.values()]:
            var.assign(hvd.broadcast(tf.convert_to_tensor(var), root_rank=0))
        self.count = int(hvd.broadcast(tf.constant(self.count, tf.int64), 0))

    # -------------------------------------------------------------------------- math
    def _forward(self, x, training: bool):
        tf, v = self.tf, self.vars
        if self.sharded is not None and self.sharded.stage == 3:  # parameters gathered per unit
            return self.sharded.forward(x)
        if self.native:
            return self.keras_model.model(x, training=training)
        if self.is_gpt:
            from adapters._gpt_tf import gpt_forward

            return gpt_forward(tf, self.spec, v, x)
        if isinstance(self.spec, CNN):
            for i in range(len(self.spec.channels)):
                x = tf.nn.relu(tf.nn.conv2d(x, v[f"convs.{i}.kernel"], 1, "SAME")
                               + v[f"convs.{i}.bias"])
            return tf.matmul(tf.reshape(x, [tf.shape(x)[0], -1]), v["head.kernel"]) \
                + v["head.bias"]
        for i in range(self.spec.num_layers):
            x = tf.matmul(x, self.vars[f"layers.{i}.kernel"]) + self.vars[f"layers.{i}.bias"]
            if i < self.spec.num_layers - 1:
                x = tf.nn.relu(x) if self.spec.activation == "relu" else tf.tanh(x)
        return x

    def _per_sample_loss(self, out, y):
        """One loss per sample; a token-level loss (outputs with a sequence axis) is averaged
        over the sample's tokens."""
        tf = self.tf
        if self.loss_name == "custom":
            losses = self.loss_fn(out, y)
            check_per_sample(getattr(losses, "shape", ()), out.shape[0])
            return losses
        if self.loss_name == "cross_entropy":
            tokens = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=out)
            if out.shape.rank == 2:
                return tokens
            return tf.reduce_mean(tf.reshape(tokens, [tf.shape(out)[0], -1]), axis=1)
        return tf.reduce_mean(tf.square(out - tf.reshape(y, tf.shape(out))),
                              axis=tf.range(1, tf.rank(out)))

    def _local_grads(self, x, y, variables):
        """This rank's gradients w.r.t. ``variables``, summed over the micro-batches, and its
        mean loss (each micro-batch's mean divided by their number)."""
        tf, k = self.tf, self.accumulation_steps
        grads = [tf.zeros_like(v) for v in variables]
        total = tf.constant(0.0, self.dtype)
        for xc, yc in zip(tf.split(x, k), tf.split(y, k), strict=True):
            with tf.GradientTape() as tape:
                losses = self._per_sample_loss(self._forward(xc, training=True), yc)
                loss = tf.cast(tf.reduce_mean(losses), self.dtype) / k
            new = tape.gradient(loss, variables)
            grads = [a if b is None else a + tf.convert_to_tensor(b)
                     for a, b in zip(grads, new, strict=True)]
            total += loss
        return grads, total

    def _step_fn(self, x, y, scalars, seeds):
        lr, step_size, c2_sqrt = scalars[0], scalars[1], scalars[2]  # one host copy per step
        hvd = self.hvd
        if self.native:
            self.keras_model.reseed(seeds)
        variables = [self.vars[n] for n in self.names]
        grads, total = self._local_grads(x, y, variables)
        grads = [hvd.allreduce(g, op=hvd.Average, name=f"grad_{i}")
                 for i, g in enumerate(grads)]
        if self.keras_opt is not None:
            self.keras_opt.apply_gradients(zip(grads, variables, strict=True))
        else:
            apply_update(self.tf, self.opt_spec, self.vars, self.slots,
                         dict(zip(self.names, grads, strict=True)), lr, step_size, c2_sqrt)
        return total

    def _eval_fn(self, x, y):
        return self._eval_sums(self._forward(x, training=False), y)

    def _eval_sums(self, out, y):
        """Sums over ``out``'s samples: the loss, the correct predictions, each metric."""
        tf = self.tf
        loss_sum = tf.reduce_sum(self._per_sample_loss(out, y))
        correct = tf.constant(0.0, tf.float64)
        if self.loss_name == "cross_entropy":
            hits = tf.cast(tf.equal(tf.argmax(out, -1), y), tf.float64)
            correct = tf.reduce_sum(tf.reduce_mean(tf.reshape(hits, [tf.shape(out)[0], -1]), 1))
        extra = {}
        for name, fn in self.metrics.items():
            values = fn(out, y)
            check_per_sample(values.shape, out.shape[0], what=f"metric {name!r}")
            extra[name] = tf.reduce_sum(values)
        return loss_sum, correct, extra

    # -------------------------------------------------------------------------- steps
    def _inputs(self, x, y):
        """Float inputs in the backend's dtype; integer ones (token ids) stay integers, except
        for the MLP/CNN specs, whose inputs are always floats. Labels: int64 for
        cross_entropy, else integers stay integers and floats take the backend's dtype."""
        tf = self.tf
        x, y = np.asarray(x), np.asarray(y)
        keep_ints = self.native or self.is_gpt
        xt = tf.convert_to_tensor(x, None if keep_ints and _is_int(x) else self.dtype)
        if self.loss_name == "cross_entropy":
            yt = tf.convert_to_tensor(y, tf.int64)
        else:
            yt = tf.convert_to_tensor(y, tf.int64 if _is_int(y) and self.loss_name == "custom"
                                      else self.dtype)
        return xt, yt

    def train_step(self, x: np.ndarray, y: np.ndarray, lr: float | None) -> float:
        """One step; ``lr`` is ignored with a Keras optimizer (its own rate or schedule)."""
        if lr is None and self.opt_spec is not None:
            raise ToolkitError("horovod-tf needs the learning rate of each step",
                               "pass an optimizer spec (toolkit.SGD/Adam) to the Trainer, which "
                               "evaluates its schedule, or a Keras optimizer")
        lr = 0.0 if lr is None else lr
        self.count += 1
        step_size, c2_sqrt = (adam_scalars(self.opt_spec, self.count, lr)
                              if isinstance(self.opt_spec, Adam) else (0.0, 1.0))
        scalars = self.tf.constant([lr, step_size, c2_sqrt], self.dtype)
        if self.pipeline is not None:
            return self.pipeline.train_step(x, y, scalars)
        seeds = (self.keras_model.seeds(self.seed, self.steps, self.env.rank) if self.native
                 else self._no_seeds)
        with unwrapped_toolkit_errors():
            loss = self._step(*self._inputs(x, y), scalars, seeds)
        self.steps += 1
        return loss  # a scalar tensor: the Trainer converts it when it averages losses

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
        if self.pipeline is not None:
            return self.pipeline.evaluate(x, y)
        with unwrapped_toolkit_errors():
            loss_sum, correct, extra = self._eval(*self._inputs(x, y))
        result = {"loss_sum": float(loss_sum), "count": float(len(x)),
                  **{name: float(v) for name, v in extra.items()}}
        if self.loss_name == "cross_entropy":
            result["correct"] = float(correct)
        return result

    # -------------------------------------------------------------------------- collectives
    def allreduce(self, values: np.ndarray, op: str = "mean") -> np.ndarray:
        check_choice("reduction", op, ("mean", "sum"))
        hvd = self.hvd
        out = hvd.allreduce(self.tf.constant(np.asarray(values, np.float64)),
                            op=hvd.Average if op == "mean" else hvd.Sum, name="toolkit.allreduce")
        return out.numpy()

    def broadcast(self, values: np.ndarray, root: int = 0) -> np.ndarray:
        return self.hvd.broadcast(self.tf.constant(np.asarray(values)), root_rank=root,
                                  name="toolkit.broadcast").numpy()

    def barrier(self) -> None:
        self.hvd.allreduce(self.tf.constant(0.0), name="barrier")

    def sync_state(self) -> None:
        """Rank 0's non-trainable variables (BatchNorm statistics) become every rank's."""
        if self.pipeline is not None:
            return self.pipeline.sync_state()
        if self.env.world_size > 1 and self.buffers and not self.sync_batchnorm:
            for var in self.buffers.values():
                var.assign(self.hvd.broadcast(self.tf.convert_to_tensor(var), root_rank=0))

    # -------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, np.ndarray]:
        """Full tensors on every rank (a sharded or staged state is gathered)."""
        return self.pipeline.state_dict() if self.pipeline is not None else self._state()

    def _state(self) -> dict[str, np.ndarray]:
        """This rank's state (under a pipeline, its stage's variables: ``build`` set them)."""
        out = (self.sharded.state_dict() if self.sharded is not None else
               {f"params/{n}": to_host(v) for n, v in self.vars.items()})
        out.update({n: to_host(v) for n, v in self.slots.items()})
        if isinstance(self.opt_spec, Adam):
            out["opt/count"] = np.asarray(self.count, np.int64)
        out.update({f"buffers/{n}": to_host(v) for n, v in self.buffers.items()})
        if self.native:
            out["rng/step"] = np.asarray(self.steps, np.int64)
        return out

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """Full tensors in; under a sharded layout each rank keeps its shards, under a pipeline
        its stage's tensors (``vars``, ``slots`` and ``buffers`` are the stage's)."""
        if self.sharded is not None:
            self.sharded.load_state_dict(state)
            self.count = int(state.get("opt/count", self.count))
            return
        for n, v in self.vars.items():
            assign(v, state[f"params/{n}"])
        for n, v in self.slots.items():
            assign(v, state[n])
        for n, v in self.buffers.items():
            assign(v, state[f"buffers/{n}"])
        if "opt/count" in state:
            self.count = int(state["opt/count"])
        if self.native:
            self.steps = int(state["rng/step"])

    def sharded_state(self) -> tuple[dict, dict]:
        """``(replicated, pieces)`` of a sharded or pipeline layout (see
        ``toolkit.ShardedAdapter``)."""
        if self.pipeline is not None:
            return self.pipeline.sharded_state()
        if self.sharded is None:
            raise ToolkitError("sharded_state() needs a sharded layout; this run is data "
                               "parallel", "use state_dict(), or train with "
                               "layout=toolkit.Sharded(stage=...)")
        replicated, pieces = self.sharded.sharded_state()
        if isinstance(self.opt_spec, Adam):
            replicated["opt/count"] = np.asarray(self.count, np.int64)
        return replicated, pieces

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of the parameters, gradients and optimizer state this rank holds (data
        parallel: every parameter, a gradient as large, every slot; a pipeline: its stage's)."""
        if self.sharded is not None:
            return self.sharded.memory_bytes()
        params = sum(to_host(v).nbytes for v in self.vars.values())
        return {"params": params, "grads": params,
                "optimizer": sum(to_host(v).nbytes for v in self.slots.values())}

    def shutdown(self) -> None:
        self.hvd.shutdown()


def _is_int(a: np.ndarray) -> bool:
    return np.issubdtype(a.dtype, np.integer)
