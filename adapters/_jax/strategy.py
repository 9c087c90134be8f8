"""What the two JAX backends' strategies share: the Flax model, the optax optimizer, the step's
host side and state naming (``JaxStrategy``). The runtime is ``adapters/_jax/runtime.py``."""

from __future__ import annotations

from typing import Any

import numpy as np

from adapters._backend import StrategyBase
from adapters._common import check_per_sample, loss_name, step_seed
from adapters._jax.models.spec import JaxModel, correct_per_sample, per_sample_loss
from adapters._jax.precision import JaxPrecision
from adapters._jax.runtime import gloo_connect_line_silenced
from adapters._jax.update import make_optimizer, step_scalars
from adapters._update import UpdateRule
from toolkit import SGD, Adam, ToolkitError


class LocalMean:
    """This process's mean loss of one step, fetched from the devices only when converted
    with ``float()``: until then the host is free to launch the next step (JAX dispatches
    asynchronously), and the Trainer converts only when it averages losses across ranks."""

    __slots__ = ("_parts",)

    def __init__(self, parts):
        self._parts = parts

    def __float__(self) -> float:
        return float(np.mean(np.concatenate([np.asarray(p).reshape(-1) for p in self._parts])))

    def __format__(self, spec: str) -> str:
        return format(float(self), spec)

    def __repr__(self) -> str:
        return f"LocalMean({float(self)!r})"


class JaxStrategy(StrategyBase):
    """What every JAX strategy shares on the host: the Flax model and optax optimizer of one
    build (``_build_common``), inputs and labels, the step's optimizer scalars and dropout
    seed, the compiled step's first call, the accumulated gradient, evaluation sums, and the
    state under the checkpoint's names. The pipeline executors keep one as their host side."""

    clips = True  # build takes clip_grad_norm
    skips = True  # build takes skip_nonfinite; its StepResult then says skipped
    plugin = JaxPrecision  # (adapters/_precision.py)
    # the data-parallel and sharded steps advance the update's counters themselves: the skip
    # and the loss scale stay on the device until the Trainer's flush (adapters/_update.py)
    defers = True

    def __init__(self, runtime, layout, precision: Any = None):
        super().__init__(runtime, layout, precision)
        self.name = runtime.backend
        self.jax, self.jnp = runtime.jax, runtime.jnp
        self.dtype, self.dtype_name = runtime.dtype, runtime.dtype_name
        self.rule = UpdateRule()  # the build's clip, skip and spec optimizer count
        self.recompute = False  # activation_checkpointing of the build

    def barrier(self) -> None:
        self.runtime.barrier()

    def sync_state(self) -> None:
        """Nothing to do: every device holds the same BatchNorm statistics (jax-pmap averages
        them each step, jax-pjit computes them over the global batch)."""

    def start_counting(self, loss, optimizer, clip: float | None = None,
                       skip: bool = False) -> None:
        """The loss and the update rule for a build made elsewhere (a pipeline executor's):
        ``labels`` and ``optimizer_scalars`` then work as after ``_build_common``."""
        self.loss_name, self.loss_fn = loss_name(loss), loss
        self.opt_spec = optimizer if isinstance(optimizer, SGD | Adam) else None
        self.rule = UpdateRule(optimizer, clip, skip, self.precision.scaler)
        self.steps = 0

    def count_step(self) -> None:
        """One more training step taken (a step that draws no dropout key)."""
        self.steps += 1

    def _build_common(self, model, optimizer, loss, seed, accumulation_steps, metrics=None,
                      init_opt: bool = True):
        """Initial ``(params, opt_state, model_state)`` as host trees, rank 0's everywhere
        (``init_opt=False``: an empty one, for layouts that create their own shards)."""
        self.loss_name, self.loss_fn = loss_name(loss), loss
        self.metrics = dict(metrics or {})
        self.accumulation_steps, self.seed = accumulation_steps, seed
        self.model = JaxModel(model, seed, self.dtype_name, self.name, self.recompute)
        self.tx = make_optimizer(optimizer, self.name)
        self.opt_spec = optimizer if isinstance(optimizer, SGD | Adam) else None
        self.steps = 0  # training steps taken: the next step's dropout key derives from it
        tmap = self.jax.tree_util.tree_map
        params = tmap(self._cast, self.model.params)
        model_state = tmap(self._cast, self.model.state)
        opt_state = tmap(np.asarray, self.tx.init(params)) if init_opt else {}
        if self.env.world_size > 1:  # rank 0's initial state becomes everyone's
            from jax.experimental import multihost_utils

            with gloo_connect_line_silenced():  # the first cross-process collective
                params, opt_state, model_state = multihost_utils.broadcast_one_to_all(
                    (params, opt_state, model_state))
        return params, opt_state, model_state

    def _cast(self, a) -> np.ndarray:
        a = np.asarray(a)
        return a.astype(self.dtype_name) if np.issubdtype(a.dtype, np.floating) else a

    def optimizer_scalars(self, lr: float | None) -> np.ndarray:
        """This step's scalars (``UpdateRule.step_scalars``: a ``StepScalars`` vector, or
        ``Deferred`` ones; the step reads them by name: ``_jax/update.py`` ``step_scalars``);
        a spec optimizer needs ``lr``, a native optax one keeps its own."""
        if self.opt_spec is not None and lr is None:
            raise ToolkitError(f"{self.name} needs the learning rate of each step",
                               "pass an optimizer spec (toolkit.SGD/Adam)")
        return self.rule.step_scalars(lr, self.dtype_name)

    def scalars_like(self) -> Any:
        """Zeros shaped as each step's ``optimizer_scalars`` (for compiling ahead; counts
        nothing)."""
        return self.rule.deferred_like(self.dtype_name)

    def _unmapped_scalars(self) -> Any:
        """``jax.pmap``'s ``in_axes`` for the step's scalars: None for each of their leaves,
        spelled out (None as a prefix of ``Deferred`` scalars maps their table over the devices
        when an earlier argument is an empty dict, an optimizer without slots or a model
        without state: jax 0.10's pmap)."""
        return self.jax.tree_util.tree_map(lambda _: None, self.scalars_like())

    def loss_scale(self, scalars):
        """(in the step) The loss scale among the step's ``scalars``; None without scaling."""
        return self.precision.step_scale(step_scalars(scalars))

    def _step_seed(self) -> np.ndarray:
        """The seed of this step's dropout key, from (seed, step): a resume draws the same."""
        self.steps += 1
        return np.asarray(step_seed(self.seed, self.steps - 1, 0), np.uint32)

    def inputs(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x)
        # copy=False: a batch already of the model's dtype is not copied (0.5 ms per step for
        # a 256 x 256 float32 batch, measured, while the step's own threads fill the cores).
        return x.astype(self.dtype_name, copy=False) if np.issubdtype(x.dtype, np.floating) \
            else x.astype(np.int32, copy=False)

    def labels(self, y: np.ndarray) -> np.ndarray:
        if self.loss_name == "cross_entropy":
            return np.asarray(y, np.int32)
        return self.inputs(y)

    _compiled_for = None

    def _run_step(self, step, args: tuple, ahead: bool = True):
        """``step(*args)``; a jitted step (``ahead``) is compiled ahead of its first call for
        these batch shapes, then a barrier: no process starts the step's collectives while
        another is still compiling (XLA's CPU collectives time out after 30 s when processes
        drift apart: jax issue 40831). A pmapped step cannot be compiled ahead for the local
        shapes of a multi-process run (``lower`` takes global ones), so the processes only meet
        at a barrier before its first call, to start compiling together."""
        shapes = tuple((np.shape(a), a.dtype) for a in args[3:5])
        if self._compiled_for != shapes:
            if ahead:
                self._compiled = step.lower(*args).compile()
                self.barrier()
            else:
                self.barrier()
                self._compiled = step
            self._compiled_for = shapes
        return self._compiled(*args)

    def _accumulated_grads(self, params, model_state, x, y, key, forward=None, scale=None,
                           cast_params=True):
        """Gradients of the batch mean over ``accumulation_steps`` micro-batches (unrolled:
        the count is static), every sample's loss in batch order, and the new model state;
        with a loss ``scale``, the gradients of the scaled mean (the update unscales them).

        ``forward(params, model_state, xb, rng) -> (outputs, model_state)`` replaces the Flax
        model's training forward (the sharded layouts pass their flat buffers through it)."""
        jax, jnp, k = self.jax, self.jnp, self.accumulation_steps
        if forward is None:
            def forward(params, model_state, xb, rng):
                return self.model.apply(params, model_state, xb, train=True, rng=rng)

        compute = self.precision.compute

        def loss_fn(params, model_state, xb, yb, rng):  # mean for the gradient, per sample too
            if compute is not None:  # mixed precision: the arithmetic in the compute dtype
                # (cast_params False: ``forward`` casts them, once gathered)
                params = self.precision.in_compute(params) if cast_params else params
                xb = self.precision.in_compute(xb)
            out, model_state = forward(params, model_state, xb, rng)
            # the loss in the parameters' dtype (float32 under mixed precision)
            losses = per_sample_loss(jnp, self.loss_fn, out.astype(self.dtype), yb)
            mean = jnp.mean(losses)
            return self.precision.scale_loss(mean, scale), (losses, model_state)

        if k == 1:  # (no zeros to add the one gradient to)
            (_, (losses, model_state)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                params, model_state, x, y, jax.random.fold_in(key, 0))
            return grads, losses, model_state
        xs = x.reshape((k, -1) + x.shape[1:])
        ys = y.reshape((k, -1) + y.shape[1:])
        grads = jax.tree_util.tree_map(jnp.zeros_like, params)
        per_sample = []
        for i in range(k):
            (_, (losses, model_state)), g = jax.value_and_grad(loss_fn, has_aux=True)(
                params, model_state, xs[i], ys[i], jax.random.fold_in(key, i))
            grads = jax.tree_util.tree_map(lambda a, b: a + b / k, grads, g)
            per_sample.append(losses)
        return grads, jnp.concatenate(per_sample), model_state

    def _eval_fn(self, params, model_state, x, y):
        jnp = self.jnp
        if self.precision.compute is not None:  # evaluated in the arithmetic it trains in
            params, x = self.precision.in_compute(params), self.precision.in_compute(x)
        out, _ = self.model.apply(params, model_state, x, train=False)
        out = out.astype(self.dtype)
        sums = {"loss_sum": jnp.sum(per_sample_loss(jnp, self.loss_fn, out, y))}
        if self.loss_name == "cross_entropy":
            sums["correct"] = correct_per_sample(jnp, out, y)
        for name, fn in self.metrics.items():
            values = fn(out, y)
            check_per_sample(values.shape, out.shape[0], what=f"metric {name!r}")
            sums[name] = jnp.sum(values)
        return sums

    def _eval_result(self, sums, n: int) -> dict[str, float]:
        return {**{k: float(v) for k, v in sums.items()}, "count": float(n)}

    # ------------------------------------------------------------------ state
    def _export(self, params, opt_state, model_state) -> dict[str, np.ndarray]:
        out = {f"params/{n}": np.array(v) for n, v in self.model.flat(params).items()}
        if self.opt_spec is not None:
            for slot, tree in opt_state.items():
                out.update({f"opt/{slot}/{n}": np.array(v)
                            for n, v in self.model.flat(tree).items()})
        else:  # a native optax state: every leaf under its tree path ("opt/0.mu.Dense_0.kernel")
            out.update({n: np.array(v) for n, v in self._optax_leaves(opt_state)})
        out.update(self.rule.counters())  # a spec's count, the loss scaler's state
        out.update({n: np.array(v) for n, v in self.model.flat_state(model_state).items()})
        if self.model.native:
            out["rng/step"] = np.asarray(self.steps, np.int64)
        return out

    def _optax_leaves(self, opt_state) -> list[tuple[str, Any]]:
        """``(opt/<tree path>, leaf)`` for every leaf of a native optax state, in tree order."""
        keystr = self.jax.tree_util.keystr
        return [("opt/" + keystr(path, simple=True, separator="."), leaf)
                for path, leaf in self.jax.tree_util.tree_flatten_with_path(opt_state)[0]]

    def _import(self, state: dict[str, np.ndarray], params_like, opt_like, model_state_like):
        def take(prefix, like):
            names = self.model.flat(like)
            return self.model.unflat(
                {n: np.asarray(state[f"{prefix}/{n}"], self.dtype_name) for n in names}, like)

        params = take("params", params_like)
        if self.opt_spec is not None:
            opt_state = {slot: take(f"opt/{slot}", tree) for slot, tree in opt_like.items()}
        else:
            leaves = [np.asarray(state[n], np.asarray(v).dtype)
                      for n, v in self._optax_leaves(opt_like)]
            opt_state = self.jax.tree_util.tree_unflatten(
                self.jax.tree_util.tree_structure(opt_like), leaves)
        like = self.model.flat_state(model_state_like)
        model_state = self.model.unflat_state(
            {n: np.asarray(state[n], np.asarray(v).dtype) for n, v in like.items()},
            model_state_like)
        self.rule.load(state)
        if self.model.native:
            self.steps = int(state["rng/step"])
        return params, opt_state, model_state

