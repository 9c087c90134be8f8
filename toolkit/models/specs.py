"""Framework-neutral descriptions of a model, an optimizer, a schedule and a loss.

A spec is plain data. Its parameters are initialised once, in numpy, from a seed, and every
backend builds the same function from the same arrays: that is what makes equivalence across
frameworks something a test can prove rather than hope for.

Parameter names and layouts are the checkpoint format's: ``layers.{i}.kernel`` has shape
``(fan_in, fan_out)`` (``y = x @ kernel + bias``); a backend whose framework stores weights the
other way round (torch's ``Linear``) transposes when it imports and exports.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from toolkit.errors import ToolkitError
from toolkit.models.choices import ACTIVATIONS, DTYPES, LOSSES, check_choice
from toolkit.models.gpt import GPT


def _exact(a: np.ndarray) -> np.ndarray:
    """No rounding: the arithmetic of the arrays' own dtype."""
    return a


@dataclasses.dataclass(frozen=True)
class MLP:
    """A multi-layer perceptron: dense layers with an activation between them (not after the last).

    Args:
        sizes: layer widths from input to output, e.g. ``(64, 128, 10)``.
        activation: ``relu`` or ``tanh``.

    Example:
        >>> params = MLP((64, 128, 10)).init(seed=0)
        >>> sorted((k, v.shape) for k, v in params.items())[:2]
        [('layers.0.bias', (128,)), ('layers.0.kernel', (64, 128))]
    """

    sizes: tuple[int, ...]
    activation: str = "relu"

    def __post_init__(self) -> None:
        object.__setattr__(self, "sizes", tuple(int(s) for s in self.sizes))
        if len(self.sizes) < 2 or min(self.sizes) < 1:
            raise ToolkitError(f"MLP sizes {self.sizes} need at least an input and an output "
                               "width, all positive", "for digits use e.g. MLP((64, 128, 10))")
        check_choice("activation", self.activation, ACTIVATIONS)

    def init(self, seed: int, dtype: str = "float32") -> dict[str, np.ndarray]:
        """Initial parameters, the same on every machine for the same seed.

        Uniform in ``±1/sqrt(fan_in)`` for kernels and biases (PyTorch's default for Linear).
        """
        check_choice("dtype", dtype, DTYPES)
        rng = np.random.default_rng(seed)
        params = {}
        for i, (fan_in, fan_out) in enumerate(zip(self.sizes[:-1], self.sizes[1:], strict=True)):
            bound = 1.0 / math.sqrt(fan_in)
            kernel = rng.uniform(-bound, bound, (fan_in, fan_out))
            params[f"layers.{i}.kernel"] = kernel.astype(dtype)
            params[f"layers.{i}.bias"] = rng.uniform(-bound, bound, (fan_out,)).astype(dtype)
        return params

    @property
    def num_layers(self) -> int:
        return len(self.sizes) - 1

    def apply(self, params: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
        """The forward pass in numpy (the reference backends are checked against)."""
        return self._forward(params, x)[0][-1]

    def _forward(self, params, x, r=_exact):
        """Activations and pre-activations; ``r`` rounds each operation's result to the
        compute dtype (``toolkit.precision.rounding``; exact by default)."""
        hs, zs = [r(x)], []
        for i in range(self.num_layers):
            kernel, bias = r(params[f"layers.{i}.kernel"]), r(params[f"layers.{i}.bias"])
            zs.append(r(hs[-1] @ kernel + bias))  # one rounding: products, sum and bias
            last = i == self.num_layers - 1
            hs.append(zs[-1] if last else
                      np.maximum(zs[-1], 0) if self.activation == "relu" else r(np.tanh(zs[-1])))
        return hs, zs

    def loss_and_grads(self, params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray,
                       loss: str = "cross_entropy", compute: str | None = None,
                       scale: float = 1.0) -> tuple[float, dict[str, np.ndarray]]:
        """Mean loss over the batch and its gradients, by hand in numpy (the reference).

        ``compute``: a narrower dtype for the arithmetic (``bfloat16``, ``float16``), rounded
        where the mixed-precision contract says (docs/precision.md): the inputs, parameters
        and every layer's output rounded once; the loss (and its gradient) from the outputs in
        full precision, that gradient rounded on its way back; each gradient matmul and sum
        rounded once; the parameters' gradients returned in their own dtype. ``scale``: the
        loss scale (fp16): the gradients returned are those of ``scale`` x the loss."""
        check_choice("loss", loss, LOSSES)
        from toolkit.precision import rounding

        r = rounding(compute)
        hs, zs = self._forward(params, x, r)
        value, dz = _loss_grad(hs[-1], y, loss)
        dz = r(dz * scale)
        grads = {}
        for i in reversed(range(self.num_layers)):
            like = params[f"layers.{i}.kernel"].dtype
            grads[f"layers.{i}.kernel"] = r(hs[i].T @ dz).astype(like, copy=False)
            grads[f"layers.{i}.bias"] = r(dz.sum(0)).astype(like, copy=False)
            if i:
                dh = r(dz @ r(params[f"layers.{i}.kernel"]).T)
                dz = (dh * (zs[i - 1] > 0) if self.activation == "relu"
                      else r(dh * (1 - hs[i] ** 2)))
        return float(value), grads


def _loss_grad(out: np.ndarray, y: np.ndarray, loss: str) -> tuple[float, np.ndarray]:
    """Mean loss over the batch and its gradient with respect to ``out``."""
    n = len(out)
    if loss == "cross_entropy":
        p = np.exp(out - out.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        value = -np.log(p[np.arange(n), y]).mean()
        p[np.arange(n), y] -= 1
        return float(value), p / n
    diff = out - y.reshape(out.shape)
    return float((diff ** 2).mean()), 2 * diff / diff.size


@dataclasses.dataclass(frozen=True)
class CNN:
    """Convolutions (k x k, stride 1, SAME padding, each followed by relu), then one dense
    layer on the flattened feature maps. Images are NHWC.

    Parameter layouts: ``convs.{i}.kernel`` is ``(k, k, in, out)`` (HWIO), ``convs.{i}.bias``
    ``(out,)``, ``head.kernel`` ``(H*W*C, classes)`` over the maps flattened in (h, w, c)
    order, ``head.bias`` ``(classes,)``.

    Args:
        image_shape: ``(height, width, channels)`` of one input.
        channels: output channels of each convolution.
        classes: outputs of the dense head.
        kernel_size: odd ``k``.
    """

    image_shape: tuple[int, int, int]
    channels: tuple[int, ...]
    classes: int
    kernel_size: int = 3

    def __post_init__(self) -> None:
        object.__setattr__(self, "image_shape", tuple(int(v) for v in self.image_shape))
        object.__setattr__(self, "channels", tuple(int(v) for v in self.channels))
        if (len(self.image_shape) != 3 or min(self.image_shape) < 1 or not self.channels
                or min(self.channels) < 1 or self.classes < 1 or self.kernel_size % 2 == 0):
            raise ToolkitError(
                f"CNN(image_shape={self.image_shape}, channels={self.channels}, "
                f"classes={self.classes}, kernel_size={self.kernel_size}) is not a valid network",
                "for digits use CNN(image_shape=(8, 8, 1), channels=(8,), classes=10)")

    @property
    def activation(self) -> str:
        return "relu"

    def init(self, seed: int, dtype: str = "float32") -> dict[str, np.ndarray]:
        """Uniform in ``±1/sqrt(fan_in)`` (PyTorch's default for Conv2d and Linear)."""
        check_choice("dtype", dtype, DTYPES)
        rng = np.random.default_rng(seed)
        h, w, c = self.image_shape
        k = self.kernel_size
        params = {}
        for i, out in enumerate(self.channels):
            bound = 1.0 / math.sqrt(k * k * c)
            params[f"convs.{i}.kernel"] = rng.uniform(-bound, bound, (k, k, c, out)).astype(dtype)
            params[f"convs.{i}.bias"] = rng.uniform(-bound, bound, (out,)).astype(dtype)
            c = out
        bound = 1.0 / math.sqrt(h * w * c)
        params["head.kernel"] = rng.uniform(-bound, bound, (h * w * c, self.classes)).astype(dtype)
        params["head.bias"] = rng.uniform(-bound, bound, (self.classes,)).astype(dtype)
        return params

    def _patches(self, x: np.ndarray) -> np.ndarray:
        """(N, H, W, C) -> (N, H, W, k*k*C), SAME padding, in the kernel's (i, j, c) order."""
        k, (_, h, w, _) = self.kernel_size, x.shape
        pad = k // 2
        xp = np.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
        return np.concatenate([xp[:, i:i + h, j:j + w, :] for i in range(k) for j in range(k)],
                              axis=-1)

    def _forward(self, params, x):
        acts, patches = [x], []
        for i in range(len(self.channels)):
            kernel = params[f"convs.{i}.kernel"]
            patches.append(self._patches(acts[-1]))
            z = patches[-1] @ kernel.reshape(-1, kernel.shape[-1]) + params[f"convs.{i}.bias"]
            acts.append(np.maximum(z, 0))
        flat = acts[-1].reshape(len(x), -1)
        return flat @ params["head.kernel"] + params["head.bias"], acts, patches

    def apply(self, params: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
        """The forward pass in numpy (the reference backends are checked against)."""
        return self._forward(params, x)[0]

    def loss_and_grads(self, params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray,
                       loss: str = "cross_entropy") -> tuple[float, dict[str, np.ndarray]]:
        """Mean loss over the batch and its gradients, by hand in numpy (the reference)."""
        check_choice("loss", loss, LOSSES)
        out, acts, patches = self._forward(params, x)
        value, dout = _loss_grad(out, y, loss)
        flat = acts[-1].reshape(len(x), -1)
        grads = {"head.kernel": flat.T @ dout, "head.bias": dout.sum(0)}
        dz = (dout @ params["head.kernel"].T).reshape(acts[-1].shape) * (acts[-1] > 0)
        k, pad = self.kernel_size, self.kernel_size // 2
        for i in reversed(range(len(self.channels))):
            kernel = params[f"convs.{i}.kernel"]
            cols = patches[i].reshape(-1, patches[i].shape[-1])
            grads[f"convs.{i}.kernel"] = (cols.T @ dz.reshape(-1, kernel.shape[-1])).reshape(
                kernel.shape)
            grads[f"convs.{i}.bias"] = dz.sum((0, 1, 2))
            if i:
                dcols = dz @ kernel.reshape(-1, kernel.shape[-1]).T
                n, h, w, c = acts[i].shape
                dxp = np.zeros((n, h + 2 * pad, w + 2 * pad, c), dz.dtype)
                for a in range(k):
                    for b in range(k):
                        part = (a * k + b) * c
                        dxp[:, a:a + h, b:b + w, :] += dcols[..., part:part + c]
                dz = dxp[:, pad:pad + h, pad:pad + w, :] * (acts[i] > 0)
        return value, grads


ModelSpec = MLP | CNN | GPT


def spec_from_dict(described: dict | None) -> ModelSpec | None:
    """The model spec a checkpoint's manifest describes (``{"type": "MLP", ...}``), if any."""
    if not described:
        return None
    kinds = {"MLP": MLP, "CNN": CNN, "GPT": GPT}
    fields = {k: v for k, v in described.items() if k != "type"}
    if described.get("type") not in kinds:
        raise ToolkitError(f"unknown model type {described.get('type')!r} in the manifest",
                           f"this toolkit knows: {', '.join(kinds)}")
    return kinds[described["type"]](**fields)


@dataclasses.dataclass(frozen=True)
class WarmupCosine:
    """Linear warm-up from 0 to ``peak`` over ``warmup_steps``, then cosine decay to ``end``.

    Evaluated on the host in float64, so every backend sees the same learning rate each step.
    """

    peak: float
    warmup_steps: int
    total_steps: int
    end: float = 0.0

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.peak * (step + 1) / self.warmup_steps
        span = max(1, self.total_steps - self.warmup_steps)
        t = min(1.0, (step - self.warmup_steps) / span)
        return self.end + 0.5 * (self.peak - self.end) * (1.0 + math.cos(math.pi * t))


Schedule = float | WarmupCosine


@dataclasses.dataclass(frozen=True)
class SGD:
    """SGD with optional (Nesterov) momentum and L2 weight decay added to the gradient.

    ``buf = momentum * buf + (grad + weight_decay * param)``; ``param -= lr * buf``
    (``grad + momentum * buf`` for Nesterov): torch.optim.SGD's arithmetic, dampening 0.
    """

    lr: Schedule
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0

    @property
    def name(self) -> str:
        return "sgd"


@dataclasses.dataclass(frozen=True)
class Adam:
    """Adam; with ``decoupled=True`` AdamW (decay applied to the parameter, scaled by lr).

    Update, with bias corrections ``c1 = 1 - b1**t`` and ``c2 = 1 - b2**t`` computed on the host
    in double precision (as torch.optim does):
    ``param -= lr / c1 * m / (sqrt(v) / sqrt(c2) + eps)``.
    ``eps`` is added outside the square root. Coupled ``weight_decay`` adds ``wd * param`` to the
    gradient; decoupled multiplies the parameter by ``1 - lr * wd`` first.
    """

    lr: Schedule
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled: bool = False

    @property
    def name(self) -> str:
        return "adamw" if self.decoupled else "adam"


OptimizerSpec = SGD | Adam


def learning_rate(optimizer: OptimizerSpec, step: int) -> float:
    """The learning rate of ``optimizer`` at (0-based) ``step``."""
    lr = optimizer.lr
    return float(lr(step)) if callable(lr) else float(lr)


def lr_scale(mode: str, world_size: int) -> float:
    """The factor ``none`` (1), ``linear`` (N) or ``sqrt`` (sqrt N) for N ranks.

    Scaling is for users who grow the global batch with the world size (weak scaling); with a
    fixed global batch keep ``none``, or the result depends on how many ranks ran it.
    """
    check_choice("lr scaling", mode, ("none", "linear", "sqrt"))
    return {"none": 1.0, "linear": float(world_size), "sqrt": math.sqrt(world_size)}[mode]
