"""The ``horovod-tf`` backend: TensorFlow 2 with Horovod's core TensorFlow ops.

Built on ``horovod.tensorflow`` (allreduce/broadcast ops) and ``tf.GradientTape``, not on
``horovod.tensorflow.keras``, which targets Keras 2 and breaks with Keras 3. The step (forward,
backward, gradient allreduce, update) is one ``tf.function``. The optimizer arithmetic is
torch.optim's, written in TF ops (see ``toolkit._reference``), so the backends agree to rounding.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from adapters._common import BackendBase, check_world, missing_framework
from toolkit import CNN, MLP, SGD, Adam, LaunchEnv, ToolkitError
from toolkit._reference import adam_scalars, optimizer_slots
from toolkit._specs import check_choice


class HorovodTFAdapter(BackendBase):
    """TensorFlow + Horovod. See :class:`toolkit.Adapter` for the contract."""

    name = "horovod-tf"

    def setup(self, env: LaunchEnv) -> None:
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
        hvd.init()
        check_world(self.name, env, hvd.size(), hvd.rank())
        self.dtype = {"float32": tf.float32, "float64": tf.float64}[self.dtype_name]

    # -------------------------------------------------------------------------- build
    def build(self, model: Any, optimizer: Any, loss: str, *, seed: int = 0,
              accumulation_steps: int = 1) -> None:
        tf = self.tf
        self.loss_name, self.accumulation_steps = loss, accumulation_steps
        spec = model if isinstance(model, MLP | CNN) else _mlp_from_keras(model)
        params = spec.init(seed, self.dtype_name) if isinstance(model, MLP | CNN) else \
            _keras_weights(model, self.dtype_name)
        self.spec = spec
        self.names = list(params)
        self.vars = {n: tf.Variable(v, name=n.replace(".", "_")) for n, v in params.items()}
        if not isinstance(optimizer, SGD | Adam):
            raise ToolkitError(f"horovod-tf cannot build an optimizer from {optimizer!r}",
                               "pass toolkit.SGD(...) or toolkit.Adam(...)")
        self.opt_spec = optimizer
        self.slots = {f"opt/{slot}/{n}": tf.Variable(tf.zeros_like(v))
                      for slot in optimizer_slots(optimizer) for n, v in self.vars.items()}
        self.count = 0  # optimizer steps taken (Adam's t), kept on the host
        self._broadcast_state()
        self._step = tf.function(self._step_fn, reduce_retracing=True)
        self._eval = tf.function(self._eval_fn, reduce_retracing=True)

    def _broadcast_state(self) -> None:
        hvd = self.hvd
        for var in [*self.vars.values(), *self.slots.values()]:
            var.assign(hvd.broadcast(var, root_rank=0))
        self.count = int(hvd.broadcast(self.tf.constant(self.count, self.tf.int64), 0))

    # -------------------------------------------------------------------------- math
    def _forward(self, x):
        tf, v = self.tf, self.vars
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
        tf = self.tf
        if self.loss_name == "cross_entropy":
            return tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=out)
        return tf.reduce_mean(tf.square(out - tf.reshape(y, tf.shape(out))),
                              axis=tf.range(1, tf.rank(out)))

    def _step_fn(self, x, y, lr, step_size, c2_sqrt):
        tf, hvd, k = self.tf, self.hvd, self.accumulation_steps
        variables = [self.vars[n] for n in self.names]
        grads = [tf.zeros_like(v) for v in variables]
        total = tf.constant(0.0, self.dtype)
        for xc, yc in zip(tf.split(x, k), tf.split(y, k), strict=True):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(self._per_sample_loss(self._forward(xc), yc)) / k
            grads = [a + b for a, b in zip(grads, tape.gradient(loss, variables), strict=True)]
            total += loss
        grads = [hvd.allreduce(g, op=hvd.Average, name=f"grad_{i}")
                 for i, g in enumerate(grads)]
        self._apply(dict(zip(self.names, grads, strict=True)), lr, step_size, c2_sqrt)
        return total

    def _apply(self, grads, lr, step_size, c2_sqrt) -> None:
        """toolkit._reference.apply_update, in TF ops."""
        tf, spec = self.tf, self.opt_spec
        for name in self.names:
            p, g = self.vars[name], grads[name]
            if isinstance(spec, SGD):
                if spec.weight_decay:
                    g = g + spec.weight_decay * p
                if spec.momentum:
                    buf = self.slots[f"opt/momentum/{name}"]
                    buf.assign(spec.momentum * buf + g)
                    g = g + spec.momentum * buf if spec.nesterov else buf
                p.assign_sub(lr * g)
                continue
            if spec.decoupled:
                p.assign(p * (1 - lr * spec.weight_decay))
            elif spec.weight_decay:
                g = g + spec.weight_decay * p
            m, v = self.slots[f"opt/mu/{name}"], self.slots[f"opt/nu/{name}"]
            m.assign(spec.b1 * m + (1 - spec.b1) * g)
            v.assign(spec.b2 * v + (1 - spec.b2) * g * g)
            p.assign_sub(step_size * m / (tf.sqrt(v) / c2_sqrt + spec.eps))

    def _eval_fn(self, x, y):
        tf = self.tf
        out = self._forward(x)
        loss_sum = tf.reduce_sum(self._per_sample_loss(out, y))
        correct = tf.constant(0, tf.int64)
        if self.loss_name == "cross_entropy":
            correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(out, 1), y), tf.int64))
        return loss_sum, correct

    # -------------------------------------------------------------------------- steps
    def _inputs(self, x, y):
        tf = self.tf
        ydtype = tf.int64 if self.loss_name == "cross_entropy" else self.dtype
        return tf.convert_to_tensor(x, self.dtype), tf.convert_to_tensor(y, ydtype)

    def train_step(self, x: np.ndarray, y: np.ndarray, lr: float | None) -> float:
        if lr is None:
            raise ToolkitError("horovod-tf needs the learning rate of each step",
                               "pass an optimizer spec (toolkit.SGD/Adam)")
        self.count += 1
        step_size, c2_sqrt = (adam_scalars(self.opt_spec, self.count, lr)
                              if isinstance(self.opt_spec, Adam) else (0.0, 1.0))
        c = lambda v: self.tf.constant(v, self.dtype)  # noqa: E731
        loss = self._step(*self._inputs(x, y), c(lr), c(step_size), c(c2_sqrt))
        return float(loss)

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
        loss_sum, correct = self._eval(*self._inputs(x, y))
        result = {"loss_sum": float(loss_sum), "count": float(len(x))}
        if self.loss_name == "cross_entropy":
            result["correct"] = float(correct)
        return result

    # -------------------------------------------------------------------------- collectives
    def allreduce(self, values: np.ndarray, op: str = "mean") -> np.ndarray:
        check_choice("reduction", op, ("mean", "sum"))
        hvd = self.hvd
        out = hvd.allreduce(self.tf.constant(np.asarray(values, np.float64)),
                            op=hvd.Average if op == "mean" else hvd.Sum)
        return out.numpy()

    def broadcast(self, values: np.ndarray, root: int = 0) -> np.ndarray:
        return self.hvd.broadcast(self.tf.constant(np.asarray(values)), root_rank=root).numpy()

    def barrier(self) -> None:
        self.hvd.allreduce(self.tf.constant(0.0), name="barrier")

    # -------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, np.ndarray]:
        out = {f"params/{n}": v.numpy().copy() for n, v in self.vars.items()}
        out.update({n: v.numpy().copy() for n, v in self.slots.items()})
        if isinstance(self.opt_spec, Adam):
            out["opt/count"] = np.asarray(self.count, np.int64)
        return out

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        for n, v in self.vars.items():
            v.assign(np.asarray(state[f"params/{n}"], v.dtype.as_numpy_dtype))
        for n, v in self.slots.items():
            v.assign(np.asarray(state[n], v.dtype.as_numpy_dtype))
        if "opt/count" in state:
            self.count = int(state["opt/count"])

    def shutdown(self) -> None:
        self.hvd.shutdown()


_KERAS_ACTIVATIONS = {"relu": "relu", "tanh": "tanh"}


def _mlp_from_keras(model: Any) -> MLP:
    """Maps a built Keras model made of Dense layers onto the MLP spec, or says why not."""
    import keras

    if not isinstance(model, keras.Model):
        raise ToolkitError(f"horovod-tf cannot build a model from {type(model).__name__}",
                           "pass a toolkit.MLP/CNN spec or a built keras.Sequential of Dense "
                           "layers")
    dense = []
    for layer in model.layers:
        if isinstance(layer, keras.layers.InputLayer):
            continue
        if not isinstance(layer, keras.layers.Dense):
            raise ToolkitError(
                f"Keras layer {layer.name!r} ({type(layer).__name__}) has no mapping onto the "
                "toolkit's model specs", "use Dense layers (relu/tanh between them, linear "
                "last), or describe the model with toolkit.MLP")
        dense.append(layer)
    if not dense or not model.built:
        raise ToolkitError("the Keras model has no built Dense layers",
                           "build it first, e.g. keras.Sequential([keras.Input((64,)), ...])")
    acts = [keras.activations.serialize(layer.activation) for layer in dense]
    acts = [a if isinstance(a, str) else a.get("config", {}).get("name", str(a)) for a in acts]
    hidden = set(acts[:-1])
    if acts[-1] != "linear" or len(hidden) > 1 or not hidden <= set(_KERAS_ACTIVATIONS):
        raise ToolkitError(f"Keras activations {acts} have no mapping onto toolkit.MLP",
                           "use one of relu/tanh between Dense layers and linear last")
    sizes = [dense[0].kernel.shape[0]] + [layer.units for layer in dense]
    return MLP(tuple(sizes), next(iter(hidden)) if hidden else "relu")


def _keras_weights(model: Any, dtype: str) -> dict[str, np.ndarray]:
    layers = [layer for layer in model.layers if hasattr(layer, "kernel")]
    params = {}
    for i, layer in enumerate(layers):
        params[f"layers.{i}.kernel"] = np.asarray(layer.kernel.numpy(), dtype)
        params[f"layers.{i}.bias"] = np.asarray(layer.bias.numpy(), dtype)
    return params
