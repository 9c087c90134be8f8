"""What every ``horovod-tf`` layout shares: host arrays as tensors, the loss per sample,
evaluation sums (``TFOps``), and one rank's variables, optimizer slots and host counters with
their state under the checkpoint's neutral names (``TFState``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from adapters._common import check_per_sample, loss_name
from adapters._update import UpdateRule
from adapters.horovod_tf.models.keras_native import assign, is_keras_optimizer, to_host
from toolkit import GPT, SGD, Adam, ToolkitError
from toolkit.errors import describe
from toolkit.models.reference import optimizer_slots
from toolkit.models.specs import ModelSpec


def _is_int(a: np.ndarray) -> bool:
    return np.issubdtype(a.dtype, np.integer)


class TFOps:
    """The loss (``cross_entropy``, ``mse`` or a callable) and metrics of one build of
    ``model`` (a spec or a Keras model), in the runtime's ``dtype`` (the forward's precision is
    the strategy's plugin's: ``precision.py``)."""

    def __init__(self, runtime, model: Any, loss: Any, metrics: dict[str, Any] | None = None):
        self.tf, self.dtype = runtime.tf, runtime.dtype
        self.loss_name, self.loss_fn = loss_name(loss), loss
        self.metrics = dict(metrics or {})
        self.native = not isinstance(model, ModelSpec)
        self.is_gpt = isinstance(model, GPT)

    def inputs(self, x, y):
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

    def per_sample_loss(self, out, y):
        """One loss per sample; a token-level loss (outputs with a sequence axis) is averaged
        over the sample's tokens."""
        tf = self.tf
        if out.dtype != self.dtype and out.dtype.is_floating:  # (mixed: the loss in float32)
            out = tf.cast(out, self.dtype)
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

    def eval_sums(self, out, y):
        """Sums over ``out``'s samples (traceable): the loss, the correct predictions, each
        metric."""
        tf = self.tf
        loss_sum = tf.reduce_sum(self.per_sample_loss(out, y))
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

    def result(self, sums, count: int) -> dict[str, float]:
        """``eval_sums``' tensors as the contract's dict of floats."""
        loss_sum, correct, extra = sums
        out = {"loss_sum": float(loss_sum), "count": float(count),
               **{name: float(v) for name, v in extra.items()}}
        if self.loss_name == "cross_entropy":
            out["correct"] = float(correct)
        return out


class TFState:
    """One rank's variables (``vars``: trainable, ``buffers``: non-trainable), optimizer
    (a spec's ``slots`` or a Keras optimizer's) and host counters: ``rule`` (the build's
    ``adapters._update.UpdateRule``, which counts a spec optimizer's steps, Adam's t; by default
    one without an optimizer) and ``steps`` (a native model's randomness derives from it)."""

    def __init__(self, tf, native: bool, rule: UpdateRule | None = None):
        self.tf, self.native = tf, native
        self.rule = rule if rule is not None else UpdateRule()
        self.vars: dict[str, Any] = {}
        self.buffers: dict[str, Any] = {}
        self.slots: dict[str, Any] = {}
        self.keras_opt: Any = None
        self.steps = 0

    @property
    def names(self) -> list[str]:
        return list(self.vars)

    def build_optimizer(self, model: Any, optimizer: Any, keras_model: Any = None,
                        variables: list | None = None) -> None:
        """Zero slots of a spec optimizer over ``vars``, or a Keras optimizer's own (over
        ``variables``, a pipeline stage's; None: the whole model's)."""
        tf = self.tf
        if type(optimizer).__name__ == "LossScaleOptimizer":  # (in every layout)
            raise ToolkitError(
                f"horovod-tf cannot use {describe(optimizer)}: it scales the loss and skips "
                "steps itself, beside the toolkit's update (which averages, clips and skips)",
                "pass its inner optimizer, and precision='fp16-mixed' (--precision "
                "fp16-mixed) for the toolkit's loss scaling where the model supports it")
        if isinstance(optimizer, SGD | Adam):
            self.slots = {f"opt/{slot}/{n}": tf.Variable(tf.zeros_like(v))
                          for slot in optimizer_slots(optimizer) for n, v in self.vars.items()}
        elif keras_model is not None and is_keras_optimizer(optimizer):
            self.keras_opt = optimizer
            self.slots = keras_model.build_optimizer(optimizer, "horovod-tf", variables)
        elif is_keras_optimizer(optimizer):  # over a spec model's variables (neutral names)
            from adapters.horovod_tf.keras_optim import for_stage, named_slots

            self.keras_opt = for_stage(optimizer)  # (one built before: a fresh one)
            self.keras_opt.build(list(self.vars.values()))
            self.slots = named_slots(self.keras_opt, self.vars)
        else:
            raise ToolkitError(f"horovod-tf cannot build an optimizer from {describe(optimizer)}",
                               "pass toolkit.SGD(...)/toolkit.Adam(...) or a Keras 3 optimizer "
                               "(keras.optimizers.SGD/Adam/AdamW)")

    def broadcast(self, hvd) -> None:
        """Rank 0's variables, slots and count become every rank's."""
        tf = self.tf
        for var in [*self.vars.values(), *self.buffers.values(), *self.slots.values()]:
            var.assign(hvd.broadcast(tf.convert_to_tensor(var), root_rank=0))
        count = hvd.broadcast(tf.constant(self.rule.count, tf.int64), 0)
        self.rule.load({"opt/count": np.asarray(count)})

    def scalars(self, lr: float | None, dtype) -> Any:
        """Counts the step and returns its scalars as tensors (``UpdateRule.step_scalars``:
        one host copy per step; the step reads them by name: ``update.step_scalars``); ``lr``
        is ignored with a Keras optimizer (its own rate or schedule)."""
        if lr is None and self.rule.spec is not None:
            raise ToolkitError("horovod-tf needs the learning rate of each step",
                               "pass an optimizer spec (toolkit.SGD/Adam) to the Trainer, which "
                               "evaluates its schedule, or a Keras optimizer")
        tf = self.tf
        return tf.nest.map_structure(lambda a: tf.convert_to_tensor(a, dtype),
                                     self.rule.step_scalars(lr, dtype.as_numpy_dtype))

    def counters(self) -> dict[str, np.ndarray]:
        """``opt/count`` (Adam) and ``rng/step`` (native models), as the checkpoint names them."""
        out = self.rule.counters()
        if self.native:
            out["rng/step"] = np.asarray(self.steps, np.int64)
        return out

    def state(self) -> dict[str, np.ndarray]:
        """This rank's tensors and counters under the checkpoint's names."""
        out = {f"params/{n}": to_host(v) for n, v in self.vars.items()}
        out.update({n: to_host(v) for n, v in self.slots.items()})
        out.update({f"buffers/{n}": to_host(v) for n, v in self.buffers.items()})
        return {**out, **self.counters()}

    def load(self, state: dict[str, np.ndarray]) -> None:
        """This rank's tensors from a full state (those it holds)."""
        for n, v in self.vars.items():
            assign(v, state[f"params/{n}"])
        for n, v in self.slots.items():
            assign(v, state[n])
        for n, v in self.buffers.items():
            assign(v, state[f"buffers/{n}"])
        self.rule.load(state)
        if self.native:
            self.steps = int(state["rng/step"])

    def memory_bytes(self) -> dict[str, int]:
        """Every variable this rank holds, a gradient as large as its parameters, every slot."""
        params = sum(to_host(v).nbytes for v in self.vars.values())
        return {"params": params, "grads": params,
                "optimizer": sum(to_host(v).nbytes for v in self.slots.values())}

