"""Native Keras 3 models in the ``horovod-tf`` backend: checks, stable names, all of the
model's state, per-step randomness and native Keras optimizers.

Names. Keras numbers automatic names per process (``dense``, ``dense_1``, ... in creation
order), so the same model built twice in one process gets other ``variable.path``\\ s. The
checkpoint names are the paths with that numbering redone within the model: every layer whose
name is automatic-looking (its class name in snake case, optionally ``_<n>``) is renumbered
per class in the order of its number. The first model built in a fresh process keeps exactly
its ``variable.path``\\ s; a second instance of the same model gets the same names as the first.

- ``params/<path>``: ``model.trainable_variables``;
- ``buffers/<path>``: ``model.non_trainable_variables`` (BatchNormalization's ``moving_mean``
  and ``moving_variance``, frozen layers' weights), without the seed generators' states;
- ``opt/<slot>/<param path>`` for a Keras optimizer's per-variable state (``momentum``,
  ``velocity``, ...) and ``opt/<name>`` for the rest (``iteration``, ``learning_rate``).

Randomness. Keras 3 layers draw from their own ``keras.random.SeedGenerator`` (Dropout has one
each; seedless random ops use a global one). Before every step all of them are re-seeded from
``step_seed(seed, step, rank)`` inside the compiled step, so the draws depend on (seed, step,
rank) only and a resumed run draws what an uninterrupted one would have; the checkpoint holds
the step (``rng/step``), not the generators' states.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from adapters._common import step_seed, unique_names
from adapters.horovod_tf.keras_optim import named_slots
from toolkit import ToolkitError


def _snake(name: str) -> str:
    """Keras's own class-name-to-layer-name rule (``keras.src.utils.naming.to_snake_case``)."""
    name = re.sub(r"\W+", "", name)
    name = re.sub("(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub("([a-z])([A-Z])", r"\1_\2", name).lower()


def _renames(layers) -> dict[str, str]:
    """Automatic-looking layer name -> the name it would have in a fresh process."""
    groups: dict[str, set[tuple[int, str]]] = {}
    for layer in layers:
        base = _snake(type(layer).__name__)
        match = re.fullmatch(re.escape(base) + r"(?:_(\d+))?", layer.name)
        if match:
            groups.setdefault(base, set()).add((int(match.group(1) or 0), layer.name))
    renames = {}
    for base, found in groups.items():
        for i, (_, old) in enumerate(sorted(found)):
            renames[old] = base if i == 0 else f"{base}_{i}"
    return renames


def _np_dtype(var) -> np.dtype:
    return np.dtype(getattr(var.dtype, "as_numpy_dtype", var.dtype))


def apply_precision(model: Any, layers: list, precision: Any, backend: str) -> None:
    """Sets the Keras dtype policy that computes as the run's ``precision`` (``bf16-mixed``:
    ``mixed_bfloat16``, ``fp16-mixed``: ``mixed_float16``, with the toolkit's loss scaler in
    the update) on every layer of ``model`` that computes in its variables' dtype; a layer
    already under that policy (a model built under the global policy) stays as it is. A layer
    under another mixed policy is refused: a model built under
    ``keras.mixed_precision.set_global_policy("mixed_bfloat16")`` runs with ``--precision
    bf16-mixed``, never silently in a precision the start-up block does not state."""
    target = KERAS_POLICIES.get(precision.compute_dtype) \
        if precision is not None and precision.mixed else None
    policies = [getattr(layer, "dtype_policy", None) for layer in layers]
    mixed = sorted({p.name for p in policies
                    if p is not None and p.compute_dtype != p.variable_dtype})
    if any(name != target for name in mixed):
        wanted = {v: k for k, v in KERAS_POLICIES.items()}
        run = {"bfloat16": "bf16-mixed", "float16": "fp16-mixed"}
        fixes = [f"--precision {run[wanted[m]]}" for m in mixed if m in wanted]
        raise ToolkitError(
            f"the Keras model {model.name!r} was built under the mixed precision policy "
            f"{', '.join(map(repr, mixed))}, but {backend} runs precision "
            f"{'32' if precision is None else precision.name!r}",
            f"pass {' or '.join(fixes) or 'a matching --precision'} (precision=...), which "
            "runs that policy with the toolkit's loss scaling for float16, or build the model "
            "under keras.mixed_precision.set_global_policy('float32')")
    if target is None:
        return
    for layer, policy in zip(layers, policies, strict=True):
        if policy is not None and policy.name != target:
            layer.dtype_policy = target


def to_host(var) -> np.ndarray:
    return np.array(np.asarray(var.numpy()), copy=True)


def assign(var, value) -> None:
    var.assign(np.asarray(value, _np_dtype(var)))


# the Keras dtype policy that computes as a toolkit policy does (float32 variables)
KERAS_POLICIES = {"bfloat16": "mixed_bfloat16", "float16": "mixed_float16"}


class KerasNative:
    """A built Keras model, its variables by stable name and its random generators. Under a
    mixed ``precision`` its layers compute as Keras' own mixed policy does (float32 variables
    cast to the compute dtype inside each layer's call): :func:`apply_precision`."""

    def __init__(self, model: Any, dtype: str, backend: str, precision: Any = None):
        import keras

        self.keras = keras
        if not isinstance(model, keras.Layer):
            raise ToolkitError(f"{backend} cannot build a model from {type(model).__name__}",
                               "pass a toolkit.MLP/CNN/GPT spec or a built Keras 3 model "
                               "(keras.Model, Sequential or functional)")
        if not model.built:
            raise ToolkitError(
                f"the Keras model {model.name!r} ({type(model).__name__}) is not built: it has "
                "no variables yet",
                "build it before passing it: start a Sequential/functional model with "
                "keras.Input(shape), or call the model once on a batch (model(x[:1])), or "
                "model.build((None, *input_shape))")
        if not model.trainable_variables:
            raise ToolkitError(f"the Keras model {model.name!r} has no trainable variables",
                               "unfreeze some layers (layer.trainable = True)")
        self.model = model
        layers = list(model._flatten_layers(include_self=True, recursive=True))
        apply_precision(model, layers, precision, backend)
        self._renames = _renames(layers)
        floats = sorted({str(v.dtype) for v in model.variables if "float" in str(v.dtype)})
        if floats and floats != [dtype]:
            raise ToolkitError(
                f"the Keras model's variables are {', '.join(floats)} but the backend runs "
                f"{dtype}",
                f"build the model with dtype='{dtype}' (e.g. keras.config.set_floatx('{dtype}') "
                f"before creating it), or use adapters.get('{backend}', "
                f"dtype='{floats[0]}')")
        # Seed generators: every layer's own, then the global one (created here, before any
        # tracing, so that seedless random ops inside the compiled step find it).
        from keras.src.random.seed_generator import global_seed_generator

        gens, seen = [], set()
        for layer in layers:
            for gen in getattr(layer, "_seed_generators", []):
                if id(gen) not in seen:
                    seen.add(id(gen))
                    gens.append(gen)
        gens.append(global_seed_generator())
        self.generators = gens
        states = {id(g.state) for g in gens}
        self.params = self._named(model.trainable_variables)
        self.buffers = self._named(
            [v for v in model.non_trainable_variables
             if id(v) not in states and not v.path.endswith("seed_generator_state")])

    def name_of(self, var) -> str:
        return "/".join(self._renames.get(part, part) for part in var.path.split("/"))

    def _named(self, variables) -> dict[str, Any]:
        return dict(zip(unique_names([self.name_of(v) for v in variables]), variables,
                        strict=True))

    # ---------------------------------------------------------------------- randomness
    def seeds(self, seed: int, step: int, rank: int) -> np.ndarray:
        """The generators' states for one step: ``[step_seed, i * 2**20]`` for generator i
        (Keras advances the second entry by one per draw; TF's stateless ops take both
        entries modulo 2**31 - 1)."""
        s = step_seed(seed, step, rank) % (2**31 - 1)
        return np.asarray([[s, i << 20] for i in range(len(self.generators))], np.int64)

    def reseed(self, seeds) -> None:
        """Inside the compiled step: sets every generator's state from ``seeds`` (a tensor)."""
        for i, gen in enumerate(self.generators):
            gen.state.assign(seeds[i])

    # ---------------------------------------------------------------------- optimizer
    def build_optimizer(self, optimizer: Any, backend: str,
                        variables: list | None = None) -> dict[str, Any]:
        """Builds a Keras optimizer over the model's trainable variables (``variables``: a
        pipeline stage's) or checks that it was built over them; returns its variables by
        stable name."""
        trainable = list(self.model.trainable_variables if variables is None else variables)
        if optimizer.built:
            mine = {id(v) for v in trainable}
            theirs = list(getattr(optimizer, "_trainable_variables", []))
            foreign = [v for v in theirs if id(v) not in mine]
            if foreign or len(theirs) != len(trainable):
                what = (f"{len(foreign)} variables that are not the model's (first: "
                        f"{foreign[0].path!r})" if foreign else
                        f"{len(theirs)} variables, the model has {len(trainable)} trainable ones")
                raise ToolkitError(
                    f"the Keras optimizer {optimizer.name!r} was already built over {what}",
                    "pass a fresh optimizer (the backend builds it over "
                    "model.trainable_variables), or build it over exactly those")
        else:
            optimizer.build(trainable)
        return named_slots(optimizer, self._named(trainable))


def is_keras_optimizer(optimizer: Any) -> bool:
    try:
        import keras
    except ImportError:
        return False
    return isinstance(optimizer, keras.optimizers.Optimizer)
