"""The update seam of each framework family, one step at a time, against a numpy replay.

Every strategy of a family runs its gradients through one function (``update`` in
``adapters/horovod_torch/update.py``, ``adapters/horovod_tf/update.py``,
``adapters/_jax/update.py``) and keeps its host-side state in one
``adapters._update.UpdateRule``. Here each family's ``update`` is called as its strategies call
it, in this process, on two float64 tensors with an SGD momentum slot (so that "nothing
changed" covers the optimizer state too), and compared with the same rule replayed in numpy
(``toolkit.models.reference``: unscale -> norm -> clip by ``clip / max(norm, clip)`` -> SGD
step):

- clipping with the norm above, at and below the bound, and the norm reported before clipping;
- a non-finite gradient skipped: parameters and slots bitwise as they were, the spec count
  taken back, the loss scale halved and its count of clean steps reset;
- the gradient of a loss scaled by ``2**10`` unscaled before its norm and clip;
- the loss scaler's growth after exactly ``growth_interval`` clean steps, also across a save
  and restore in the middle of an interval;
- each step's ``StepScalars`` read back by name from numpy, TF and JAX vectors.

The end-to-end runs (tests/adapters/test_skipping.py, test_clipping_jax.py,
test_mixed_precision.py) cover these only through whole trainings; here a fault in one piece
fails a named test within seconds.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import toolkit
from adapters._precision import PrecisionPlugin
from adapters._update import StepScalars, UpdateRule
from toolkit.models.reference import (
    adam_scalars,
    apply_update,
    clip_scale,
    global_norm,
    optimizer_slots,
)
from toolkit.precision import Precision

LR, SCALE, INTERVAL = 0.1, 2.0 ** 10, 3
NAMES = ("w", "b")
FAMILIES = ("torch", "tf", "jax")
OPTIMIZERS = {"sgd": lambda: toolkit.SGD(lr=LR, momentum=0.9), "adam": lambda: toolkit.Adam(lr=LR)}


def start(spec):
    """Parameters, non-zero optimizer slots (a step that changed them shows) and a gradient."""
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(3, 2)), "b": rng.normal(size=(2,))}
    slots = {f"opt/{slot}/{n}": rng.uniform(0.1, 1.0, p.shape)
             for slot in optimizer_slots(spec) for n, p in params.items()}
    return params, slots, {n: rng.normal(size=p.shape) for n, p in params.items()}


def rule_of(optimizer="sgd", clip=None, skip=False, scale=None, growth_interval=INTERVAL):
    """A rule as a build makes one (``scale``: fp16-mixed's loss scaler starting there, the
    precision plugin's)."""
    plugin = PrecisionPlugin(Precision.of("fp16-mixed").with_scaling(
        init_scale=scale, growth_interval=growth_interval) if scale else Precision.of("32"))
    return UpdateRule(OPTIMIZERS[optimizer](), clip=clip, skip=skip, scaler=plugin.scaler)


def replay(spec, params, slots, grads, clip=None, scale=None):
    """The rule in numpy: ``(params, slots, norm before clipping)`` after one SGD step."""
    if scale is not None:
        grads = {n: g / scale for n, g in grads.items()}
    norm = global_norm(grads)
    if clip is not None:
        grads = {n: g * clip_scale(norm, clip) for n, g in grads.items()}
    params, state = apply_update(spec, params, grads, slots, LR)
    return params, state, norm


# ------------------------------------------------------------------ one update per family
# Each returns (params after, slots after, the norm, skipped): skipped None where the family's
# strategies read it from the norm (UpdateRule.result).

def torch_update(rule, scalars, params, slots, grads):
    import torch

    from adapters.horovod_torch.ops import TORCH_SLOTS, make_optimizer, set_lr, zero_slots
    from adapters.horovod_torch.update import sum_of_squares, update

    tensors = [torch.nn.Parameter(torch.tensor(params[n])) for n in NAMES]
    opt = make_optimizer(torch, rule.spec, tensors)
    zero_slots(torch, opt, tensors, rule.spec)
    for name, p in zip(NAMES, tensors, strict=True):
        for slot in optimizer_slots(rule.spec):
            opt.state[p][TORCH_SLOTS[slot]].copy_(torch.tensor(slots[f"opt/{slot}/{name}"]))
        p.grad = torch.tensor(grads[name])
    set_lr(opt, scalars.lr)
    gs = [p.grad for p in tensors]
    _, norm = update(torch, rule, gs, lambda g: sum_of_squares(torch, g), lambda _: opt.step())
    return ({n: p.detach().numpy() for n, p in zip(NAMES, tensors, strict=True)},
            {f"opt/{s}/{n}": opt.state[p][TORCH_SLOTS[s]].numpy()
             for s in optimizer_slots(rule.spec) for n, p in zip(NAMES, tensors, strict=True)},
            float(norm), None)


def tf_update(rule, scalars, params, slots, grads):
    import tensorflow as tf

    from adapters.horovod_tf.update import apply_update as tf_apply_update
    from adapters.horovod_tf.update import sum_squares, update

    variables = {n: tf.Variable(params[n]) for n in NAMES}
    slot_vars = {k: tf.Variable(v) for k, v in slots.items()}

    @tf.function  # as the strategies compile their step (update's tf.cond in a graph)
    def step(gs, vector):
        s = StepScalars.of(vector)

        def apply(clipped):
            named = dict(zip(NAMES, clipped, strict=True))
            tf_apply_update(tf, rule.spec, variables, slot_vars, named, s)

        return update(tf, rule, gs, lambda g: sum_squares(tf, g), apply, (), vector)[1]

    norm = step([tf.constant(grads[n]) for n in NAMES], tf.constant(scalars.vector("float64")))
    return ({n: v.numpy() for n, v in variables.items()},
            {k: v.numpy() for k, v in slot_vars.items()}, float(norm), None)


def jax_module():
    import jax

    jax.config.update("jax_enable_x64", True)  # float64, as the JAX adapters enable it
    return jax


def jax_update(rule, scalars, params, slots, grads):
    jax = jax_module()
    import jax.numpy as jnp

    from adapters._jax.update import apply_optimizer, make_optimizer, squares, update

    tx = make_optimizer(rule.spec, "jax-pjit")
    state = {s: {n: jnp.asarray(slots[f"opt/{s}/{n}"]) for n in NAMES}
             for s in optimizer_slots(rule.spec)}

    @jax.jit
    def step(p, opt_state, g, vector):
        def apply(clipped):
            return apply_optimizer(rule, tx, clipped, opt_state, p, vector)

        return update(jnp, rule, g, lambda g: squares(jnp, g), apply, (p, opt_state), vector)

    (p, opt_state), norm = step({n: jnp.asarray(v) for n, v in params.items()}, state,
                                {n: jnp.asarray(v) for n, v in grads.items()},
                                jnp.asarray(scalars.vector("float64")))
    return ({n: np.asarray(v) for n, v in p.items()},
            {f"opt/{s}/{n}": np.asarray(v) for s, tree in opt_state.items()
             for n, v in tree.items()}, float(norm), None)


UPDATES = {"torch": torch_update, "tf": tf_update, "jax": jax_update}


def one_step(family, rule, params, slots, grads):
    """One update as a strategy runs it: the step's scalars (counting a spec step), the
    family's update, the step's ``StepResult``; ``(params, slots, norm, result)``."""
    scalars = rule.scalars(LR)
    after, slots_after, norm, skipped = UPDATES[family](rule, scalars, params, slots, grads)
    return after, slots_after, norm, rule.result(0.0, norm, skipped)


def max_diff(a, b):
    assert a.keys() == b.keys()
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


def clean_step(rule):
    """A finite step through the host side only; the loss scale it used."""
    rule.scalars(LR)
    result = rule.result(0.0, 1.0)
    assert not result.skipped and not result.overflow
    return result.loss_scale


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("ratio", [0.5, 1.0, 2.0], ids=["above", "at", "below"])
def test_clipping_equals_the_replay(family, ratio):
    """``ratio``: the bound over the gradient's norm (the norm above, at, below it)."""
    spec = OPTIMIZERS["sgd"]()
    params, slots, grads = start(spec)
    clip = ratio * global_norm(grads)
    ref_params, ref_slots, ref_norm = replay(spec, params, slots, grads, clip=clip)
    after, slots_after, norm, result = one_step(family, rule_of(clip=clip), params, slots, grads)
    assert not result.skipped
    assert abs(norm - ref_norm) <= 1e-12 * ref_norm and result.grad_norm == norm
    assert max_diff(after, ref_params) < 1e-12 and max_diff(slots_after, ref_slots) < 1e-12
    unclipped, _, _ = replay(spec, params, slots, grads)
    assert (max_diff(unclipped, ref_params) > 1e-3) == (ratio < 1)  # the clip acted, or not


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("optimizer, bad, scale", [
    ("sgd", math.nan, None), ("sgd", math.inf, SCALE),
    ("adam", -math.inf, None), ("adam", math.nan, SCALE)])
def test_a_nonfinite_gradient_changes_nothing(family, optimizer, bad, scale):
    rule = rule_of(optimizer, clip=1.0, skip=True, scale=scale)
    for _ in range(INTERVAL - 1):  # clean steps: a count and clean steps to take back
        clean_step(rule)
    count, good = rule.count, None if scale is None else rule.scaler.good_steps
    params, slots, grads = start(rule.spec)
    grads["w"][1, 0] = bad
    after, slots_after, norm, result = one_step(family, rule, params, slots, grads)
    for before, now in ((params, after), (slots, slots_after)):
        assert before.keys() == now.keys()
        for k in before:
            assert now[k].dtype == before[k].dtype and now[k].tobytes() == before[k].tobytes(), k
    assert not math.isfinite(norm) and result.skipped
    assert rule.count == count == INTERVAL - 1
    if scale is not None:
        assert good == INTERVAL - 1 and result.overflow and result.loss_scale == scale
        assert rule.scaler.scale == scale / 2 and rule.scaler.good_steps == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_the_gradient_of_a_scaled_loss_is_unscaled_first(family):
    spec = OPTIMIZERS["sgd"]()
    params, slots, grads = start(spec)
    # the true gradient is within the bound; 2**10 times it would be clipped
    clip = 2 * global_norm(grads)
    scaled = {n: g * SCALE for n, g in grads.items()}  # the gradient of the loss times SCALE
    ref_params, ref_slots, ref_norm = replay(spec, params, slots, grads, clip=clip)
    after, slots_after, norm, result = one_step(family, rule_of(clip=clip, scale=SCALE),
                                                params, slots, scaled)
    assert not result.skipped and result.loss_scale == SCALE
    assert abs(norm - ref_norm) <= 1e-12 * ref_norm
    assert max_diff(after, ref_params) < 1e-12 and max_diff(slots_after, ref_slots) < 1e-12
    forgotten, _, _ = replay(spec, params, slots, scaled, clip=clip)  # left scaled: differs
    assert max_diff(forgotten, ref_params) > 1e-3


@pytest.mark.parametrize("interval", [1, INTERVAL])
def test_the_loss_scale_doubles_after_exactly_growth_interval_clean_steps(interval):
    rule = rule_of(scale=SCALE, growth_interval=interval)
    used = [clean_step(rule) for _ in range(2 * interval)]  # the scale each step used
    assert used == [SCALE] * interval + [2 * SCALE] * interval
    assert rule.scaler.scale == 4 * SCALE and rule.scaler.good_steps == 0  # the next step's


@pytest.mark.parametrize("k", [1, INTERVAL - 1])
def test_a_restored_scaler_grows_where_an_uninterrupted_one_does(k):
    """Saved after ``k`` clean steps of an interval and loaded into a fresh rule."""
    uninterrupted = rule_of("adam", scale=SCALE)
    expected = [clean_step(uninterrupted) for _ in range(2 * INTERVAL)]
    first = rule_of("adam", scale=SCALE)
    used = [clean_step(first) for _ in range(k)]
    saved = {name: np.array(value) for name, value in first.counters().items()}
    assert int(saved["scaler/good_steps"]) == k and int(saved["opt/count"]) == k
    resumed = rule_of("adam", scale=SCALE)
    resumed.load(saved)
    used += [clean_step(resumed) for _ in range(2 * INTERVAL - k)]
    assert used == expected and resumed.count == uninterrupted.count
    assert resumed.counters().keys() == saved.keys()
    assert all(np.array_equal(value, uninterrupted.counters()[name])
               for name, value in resumed.counters().items())


@pytest.mark.parametrize("kind", ["numpy", "tf", "jax"])
def test_step_scalars_are_read_back_by_name(kind):
    if kind == "tf":
        import tensorflow as tf

        as_vector = tf.constant
    elif kind == "jax":
        as_vector = jax_module().numpy.asarray
    else:
        as_vector = np.asarray
    rule = rule_of("adam", scale=SCALE)
    for t in (1, 2, 3):
        s = rule.scalars(LR * t)
        back = StepScalars.of(as_vector(s.vector("float64")))
        step_size, c2_sqrt = adam_scalars(rule.spec, t, LR * t)
        assert (float(back.lr), float(back.step_size), float(back.c2_sqrt),
                float(back.loss_scale)) == (LR * t, step_size, c2_sqrt, SCALE)
        rule.result(0.0, 1.0)
    s = rule_of("sgd").scalars(LR)  # SGD: no Adam scalars, no loss scale
    assert tuple(float(v) for v in StepScalars.of(as_vector(s.vector("float64")))) == \
        (LR, 0.0, 1.0, 1.0)


# ------------------------------------------------------------------ deferred steps
def jax_steps(rule, dtype):
    """``(step(state, grads, scalars) -> (state, norm or Report), start state, params of a
    state)`` as the JAX strategies run the update."""
    jax = jax_module()
    import jax.numpy as jnp

    from adapters._jax.update import apply_optimizer, make_optimizer, squares, update

    tx = make_optimizer(rule.spec, "jax-pjit")
    params, slots, _ = start(rule.spec)
    state = ({n: jnp.asarray(v) for n, v in params.items()},
             {s: {n: jnp.asarray(slots[f"opt/{s}/{n}"]) for n in NAMES}
              for s in optimizer_slots(rule.spec)})

    @jax.jit
    def compiled(p, opt_state, g, scalars):
        def apply(clipped):
            return apply_optimizer(rule, tx, clipped, opt_state, p, scalars)

        return update(jnp, rule, g, lambda g: squares(jnp, g), apply, (p, opt_state), scalars)

    def step(state, grads, scalars):
        return compiled(*state, {n: jnp.asarray(v) for n, v in grads.items()}, scalars)

    return step, state, lambda state: {n: np.asarray(v) for n, v in state[0].items()}


def tf_steps(rule, dtype):
    """As :func:`jax_steps`, for the TF family's update in a ``tf.function`` (its state: the
    variables, updated in place)."""
    import tensorflow as tf

    from adapters.horovod_tf.update import apply_update as tf_apply_update
    from adapters.horovod_tf.update import step_scalars, sum_squares, update

    params, slots, _ = start(rule.spec)
    variables = {n: tf.Variable(params[n]) for n in NAMES}
    slot_vars = {k: tf.Variable(v) for k, v in slots.items()}

    @tf.function
    def compiled(gs, scalars):
        def apply(clipped):
            tf_apply_update(tf, rule.spec, variables, slot_vars,
                            dict(zip(NAMES, clipped, strict=True)), step_scalars(tf, scalars))

        return update(tf, rule, gs, lambda g: sum_squares(tf, g), apply, (), scalars)[1]

    def step(state, grads, scalars):
        scalars = tf.nest.map_structure(lambda a: tf.convert_to_tensor(a, tf.float64), scalars)
        return state, compiled([tf.constant(grads[n]) for n in NAMES], scalars)

    return step, variables, lambda state: {n: v.numpy() for n, v in state.items()}


def torch_steps(rule, dtype):
    """As :func:`jax_steps`, for the torch family's update with torch's fused optimizer (the
    one whose step takes a skip as a device flag), its state updated in place."""
    import torch

    from adapters._update import Deferred
    from adapters.horovod_torch.update import sum_of_squares, update

    params, _, _ = start(rule.spec)
    tensors = [torch.nn.Parameter(torch.tensor(params[n])) for n in NAMES]
    opt = (torch.optim.Adam(tensors, lr=LR, fused=True) if isinstance(rule.spec, toolkit.Adam)
           else torch.optim.SGD(tensors, lr=LR, momentum=0.9, fused=True))

    def apply(found_inf):
        if found_inf is not None:
            opt.found_inf, opt.grad_scale = found_inf, None
        opt.step()

    def step(state, grads, scalars):
        for p, n in zip(tensors, NAMES, strict=True):
            p.grad = torch.tensor(grads[n])
        if isinstance(scalars, Deferred):
            scalars = Deferred(*(torch.as_tensor(a) for a in scalars))
        else:
            scalars = StepScalars(*(float(v) for v in scalars))
        gs = [p.grad for p in tensors]
        _, out = update(torch, rule, gs, lambda g: sum_of_squares(torch, g), apply, (), scalars)
        return state, out

    return step, tensors, lambda state: {n: p.detach().numpy().copy()
                                         for n, p in zip(NAMES, state, strict=True)}


STEPS = {"jax": jax_steps, "tf": tf_steps, "torch": torch_steps}


def deferred_run(rule, grads_by_step, state=None, family="jax", dtype="float64"):
    """Steps of ``family``'s update under ``rule`` as its strategies run them: the rule's
    ``step_scalars`` in, its ``result`` out, from ``state`` (None: ``start``'s). Returns the
    parameters after each step, the results, how many times the host read the device's
    counters during the steps, and the last state."""
    step, start_state, params_of = STEPS[family](rule, dtype)
    state = start_state if state is None else state
    reads = []
    sync = rule.sync
    rule.sync = lambda: (reads.append(rule._device is not None), sync())[1]
    history, results = [], []
    for grads in grads_by_step:
        state, out = step(state, grads, rule.step_scalars(LR, dtype))
        results.append(rule.result(0.0, out))
        history.append(params_of(state))
    rule.sync = sync
    return history, results, sum(reads), state


def gradients(steps, bad_at, scale):
    """Every step's gradient (``scale`` times a true one), not finite at the steps ``bad_at``."""
    rng = np.random.default_rng(1)
    out = []
    for k in range(1, steps + 1):
        g = {"w": rng.normal(size=(3, 2)) * scale, "b": rng.normal(size=(2,)) * scale}
        if k in bad_at:
            g["b"][0] = math.nan
        out.append(g)
    return out


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("optimizer, scale", [("adam", None), ("adam", SCALE), ("sgd", SCALE)])
def test_a_deferred_step_equals_a_step_read_on_the_host_bit_for_bit(family, optimizer, scale):
    """Steps whose skip, Adam count and loss scale stay on the device (``defer=True``)
    against the same steps read back each step: equal parameters after every step, the same
    skips, overflows, scales, count and scaler state; and over 45 steps (past ``WINDOW``) the
    host read the device's counters only when Adam's table ran out."""
    from adapters._update import WINDOW

    bad = {2, 5, 6, 9, WINDOW + 4}  # (in the first window, three in a row, in the second)
    grads = gradients(45, bad, scale or 1.0)
    runs = []
    for defer in (False, True):
        rule = UpdateRule(OPTIMIZERS[optimizer](), clip=1.0, skip=True,
                          scaler=rule_of(scale=scale).scaler, defer=defer)
        history, results, reads, _ = deferred_run(rule, grads, family=family)
        runs.append((history, results, reads, rule))
    (host, host_results, _, host_rule), (dev, dev_results, reads, dev_rule) = runs
    assert dev_rule.deferred and not host_rule.deferred
    for k, (a, b) in enumerate(zip(host, dev, strict=True)):
        assert all(a[n].tobytes() == b[n].tobytes() for n in NAMES), f"step {k + 1}"
    assert [bool(r.skipped) for r in dev_results] == [r.skipped for r in host_results]
    assert [k + 1 for k, r in enumerate(dev_results) if r.skipped] == sorted(bad)
    assert [float(r.grad_norm).hex() for r in dev_results] == \
        [float(r.grad_norm).hex() for r in host_results]
    if scale is not None:
        assert [float(r.loss_scale) for r in dev_results] == \
            [r.loss_scale for r in host_results]
        assert [bool(r.overflow) for r in dev_results] == [r.overflow for r in host_results]
    assert reads == (1 if optimizer == "adam" else 0)  # step WINDOW + 1 needed the skips
    assert dev_rule.counters().keys() == host_rule.counters().keys()
    for name, value in host_rule.counters().items():
        assert np.array_equal(dev_rule.counters()[name], value), name


def test_a_deferred_rule_restored_from_a_checkpoint_goes_on_as_an_uninterrupted_one():
    """Saved in the middle of a window with a skip in it, loaded into a fresh deferred rule
    with the parameters and slots the steps left: every later step equals the uninterrupted
    run's bit for bit, and so do the count and the scaler."""
    grads = gradients(12, {3, 8}, SCALE)

    def rule():
        return UpdateRule(toolkit.Adam(lr=LR), clip=1.0, skip=True,
                          scaler=rule_of(scale=SCALE, growth_interval=2).scaler, defer=True)

    uninterrupted = rule()
    whole, _, _, _ = deferred_run(uninterrupted, grads)
    first = rule()
    _, _, _, state = deferred_run(first, grads[:5])  # (JAX: the state is the arrays)
    saved = {k: np.array(v) for k, v in first.counters().items()}
    # grown at 2, halved by the skip at 3, grown at 5: four optimizer steps
    assert (int(saved["opt/count"]), float(saved["scaler/scale"]),
            int(saved["scaler/good_steps"])) == (4, 2 * SCALE, 0)
    resumed = rule()
    resumed.load(saved)
    history, _, _, _ = deferred_run(resumed, grads[5:], state)
    for k, (a, b) in enumerate(zip(whole[5:], history, strict=True)):
        assert all(a[n].tobytes() == b[n].tobytes() for n in NAMES), f"step {k + 6}"
    for name, value in uninterrupted.counters().items():
        assert np.array_equal(resumed.counters()[name], value), name
