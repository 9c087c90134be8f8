"""The Flax side of the JAX backends: spec models as Flax modules, native modules with all
their variables, neutral names, and the per-sample losses.

A native model is a ``(module, variables)`` pair, ``variables = module.init(key, x)``. Every
collection besides ``params`` (``batch_stats`` of BatchNorm, any other mutable collection) is
model state: carried through each step (``mutable=``), checkpointed under
``buffers/<collection>/<path>``, and made rank 0's before evaluating and saving. When the
module's ``__call__`` takes ``train`` (or ``deterministic``), the backends pass
``train=True`` for training steps and ``False`` for evaluation, with a ``dropout`` key derived
from (seed, step) for training. A Flax NNX module is taken as it is: its own variables, split
into parameters and model state, its train/eval switched the NNX way (``models/nnx.py``).
"""

from __future__ import annotations

import inspect
from typing import Any

from adapters._common import check_per_sample
from adapters._jax.models.layers import dense
from adapters._jax.models.nnx import NnxModule, is_nnx
from toolkit import CNN, GPT, ToolkitError
from toolkit.models.specs import ModelSpec


class JaxModel:
    """A Flax module, its initial parameters and state, and the neutral names of both."""

    def __init__(self, model: Any, seed: int, dtype: str, backend: str, recompute: bool = False):
        import flax.linen as nn
        from flax import traverse_util

        self.traverse = traverse_util
        self.native = not isinstance(model, ModelSpec)
        self.flag: str | None = None
        self.state: dict[str, Any] = {}
        self.gpt = None
        if not self.native:
            if isinstance(model, GPT):
                from adapters._jax.models import gpt as flax_gpt  # (it imports Flax)

                self.gpt, self.module = flax_gpt, flax_gpt.FlaxGPT(model, recompute=recompute)
            else:
                self.module = _flax_module(nn, model, recompute)
            self.params = traverse_util.unflatten_dict(
                {self.path_of(k): v for k, v in model.init(seed, dtype).items()})
            return
        if isinstance(model, tuple) and model and is_nnx(model[0]):
            raise ToolkitError(
                f"{backend} got the Flax NNX module {type(model[0]).__name__} in a pair: an NNX "
                "module holds its own variables", "pass the module itself")
        if is_nnx(model):
            model = (NnxModule(model), None)  # its variables: the module's own
        if isinstance(model, nn.Module):
            raise ToolkitError(
                f"{backend} got the Flax module {type(model).__name__} without its variables",
                "pass (module, variables) with variables = module.init(jax.random.key(0), x)")
        if not (isinstance(model, tuple) and len(model) == 2
                and isinstance(model[0], nn.Module | NnxModule)):
            raise ToolkitError(f"{backend} cannot build a model from {type(model).__name__}",
                               "pass a toolkit.MLP/CNN/GPT spec, a (flax module, variables) "
                               "pair or a Flax NNX module")
        self.module, variables = model
        variables = dict(variables or {}) if not isinstance(self.module, NnxModule) \
            else self.module.variables()
        if not variables:
            raise ToolkitError(f"{backend}: the Flax module {type(self.module).__name__} came "
                               "with no variables", "pass variables = module.init(key, x)")
        if "params" in variables:
            self.params = variables.pop("params")
            self.state = variables
        else:  # a bare parameter tree
            self.params = variables
        arguments = inspect.signature(type(self.module).__call__).parameters \
            if not isinstance(self.module, NnxModule) else ("train",)  # (NnxModule.apply's)
        self.flag = next((f for f in ("train", "deterministic") if f in arguments), None)

    def apply(self, params, state, x, *, train: bool = False, rng=None):
        """``(outputs, new state)``; state collections are updated only when training."""
        kwargs = {}
        if self.flag == "train":
            kwargs["train"] = train
        elif self.flag == "deterministic":
            kwargs["deterministic"] = not train
        if self.native and train and rng is not None:
            kwargs["rngs"] = {"dropout": rng}
        variables = {"params": params, **state}
        if train and state:
            out, new_state = self.module.apply(variables, x, mutable=list(state), **kwargs)
            return out, dict(new_state)
        return self.module.apply(variables, x, **kwargs), state

    # Flax names submodules "layers_0", "convs_1", "head"; the spec says "layers.0", ...
    def name_of(self, path: tuple[str, ...]) -> str:
        if self.gpt is not None:
            return self.gpt.name_of(path)
        if not self.native:
            module, leaf = path
            return ".".join(module.split("_")) + "." + leaf
        return ".".join(map(str, path))  # (an NNX list's items are numbered)

    def path_of(self, name: str) -> tuple[str, ...]:
        if self.gpt is not None:
            return self.gpt.path_of(name)
        *module, leaf = name.split(".")
        return ("_".join(module), leaf)

    def flat(self, tree) -> dict[str, Any]:
        """Neutral name -> leaf."""
        return {self.name_of(k): v for k, v in self.traverse.flatten_dict(tree).items()}

    def unflat(self, flat: dict[str, Any], like) -> Any:
        paths = {self.name_of(k): k for k in self.traverse.flatten_dict(like)}
        return self.traverse.unflatten_dict({paths[n]: v for n, v in flat.items()})

    def flat_state(self, state) -> dict[str, Any]:
        """``buffers/<collection>/<path>`` -> leaf, for every non-parameter collection."""
        return {f"buffers/{c}/{'.'.join(map(str, k))}": v for c, tree in state.items()
                for k, v in self.traverse.flatten_dict(tree).items()}

    def unflat_state(self, flat: dict[str, Any], like) -> dict[str, Any]:
        return {c: self.traverse.unflatten_dict(
            {k: flat[f"buffers/{c}/{'.'.join(map(str, k))}"]
             for k in self.traverse.flatten_dict(tree)})
            for c, tree in like.items()}


def in_compute(jax, tree, dtype):
    """``tree``'s floating leaves in ``dtype`` (a mixed-precision forward's parameters and
    inputs); integer leaves (token ids) as they are."""
    jnp = jax.numpy
    return jax.tree_util.tree_map(
        lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def _flax_module(nn, spec, recompute: bool = False):
    class _Dense(nn.Module):  # nn.Dense's parameters, :func:`dense`'s arithmetic
        features: int

        @nn.compact
        def __call__(self, x):
            import jax.numpy as jnp

            init = nn.initializers.zeros  # (the spec initialises the parameters)
            kernel = self.param("kernel", init, (x.shape[-1], self.features), x.dtype)
            return dense(jnp, x, kernel, self.param("bias", init, (self.features,), x.dtype))

    if isinstance(spec, CNN):
        k = spec.kernel_size

        class FlaxCNN(nn.Module):
            @nn.compact
            def __call__(self, x):
                for i, width in enumerate(spec.channels):
                    x = nn.relu(nn.Conv(width, (k, k), padding="SAME", name=f"convs_{i}",
                                        param_dtype=x.dtype, dtype=x.dtype)(x))
                x = x.reshape((x.shape[0], -1))  # NHWC flattened as (h, w, c), as the spec
                return _Dense(spec.classes, name="head")(x)

        return FlaxCNN()

    act = nn.relu if spec.activation == "relu" else nn.tanh

    class _Hidden(nn.Module):  # a hidden layer and its activation: the recomputed unit
        features: int

        @nn.compact
        def __call__(self, x):
            import jax.numpy as jnp

            init = nn.initializers.zeros  # (the spec initialises the parameters)
            kernel = self.param("kernel", init, (x.shape[-1], self.features), x.dtype)
            return act(dense(jnp, x, kernel, self.param("bias", init, (self.features,),
                                                        x.dtype)))

    hidden = nn.remat(_Hidden) if recompute else _Hidden

    class FlaxMLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i, width in enumerate(spec.sizes[1:-1]):
                x = hidden(width, name=f"layers_{i}")(x)
            return _Dense(spec.sizes[-1], name=f"layers_{spec.num_layers - 1}")(x)

    return FlaxMLP()


def per_sample_loss(jnp, loss: Any, out, y):
    """One loss per sample; a token-level loss is averaged over the sample's tokens."""
    if callable(loss):
        losses = loss(out, y)
        check_per_sample(losses.shape, out.shape[0])
        return losses
    if loss == "cross_entropy":
        m = jnp.max(out, axis=-1, keepdims=True)
        logp = out - (m + jnp.log(jnp.sum(jnp.exp(out - m), axis=-1, keepdims=True)))
        tokens = -jnp.take_along_axis(logp, y[..., None], axis=-1)[..., 0]
        return tokens.reshape(out.shape[0], -1).mean(axis=1)
    return jnp.mean((out - y.reshape(out.shape)).reshape(out.shape[0], -1) ** 2, axis=1)


def correct_per_sample(jnp, out, y):
    """The fraction of each sample's positions whose arg-max is the label, summed."""
    hits = (jnp.argmax(out, axis=-1) == y).astype(jnp.float32)
    return jnp.sum(hits.reshape(out.shape[0], -1).mean(axis=1))

