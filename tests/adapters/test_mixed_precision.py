"""bf16-mixed and fp16-mixed against a numpy reference of the same arithmetic
(``toolkit.models.reference`` with ``compute="bfloat16"`` or ``"float16"``: inputs, parameters
and every layer's output rounded where docs/precision.md's contract says, the loss in full
precision, float32 master parameters and optimizer; for fp16 the same loss scaler).

The first steps equal the rounded reference within 1e-6 (a float32 run is 1e-5 away and fails
that bound); over 50 steps the runs drift apart only as rounding boundaries move (a float32
update that differs in its last bit flips a bfloat16 rounding later), which the looser bound
measures. In this process: world size 1 for horovod-torch, the two CPU devices of
tests/conftest.py for jax-pmap (the reference then splits each batch in two, as the devices do);
a pipeline's micro-batches are split so too.
"""

from __future__ import annotations

import numpy as np
import pytest

import adapters
import toolkit
from toolkit import ToolkitError
from toolkit.datasets import load_digits
from toolkit.models.reference import reference_run
from toolkit.precision import LossScaler

STEPS, EARLY, BATCH = 50, 10, 64
# relative: (each of the first EARLY steps, any of the STEPS steps), measured in
# docs/precision.md
BOUNDS = {"bf16-mixed": (1e-6, 3e-3), "fp16-mixed": (1.5e-6, 1e-3)}
COMPUTE = {"bf16-mixed": "bfloat16", "fp16-mixed": "float16"}
CASES = [("horovod-torch", "data", (1, 1)), ("horovod-torch", "sharded:1", (1, 1)),
         ("horovod-torch", "sharded:3", (1, 1)), ("jax-pmap", "data", (1, 2)),
         ("jax-pmap", "sharded:1", (1, 2)), ("jax-pmap", "sharded:2", (1, 2)),
         ("jax-pmap", "sharded:3", (1, 2)),
         # one program over the global batch: its arithmetic is the whole batch's
         ("jax-pjit", "data", (1, 1)), ("jax-pjit", "sharded:3", (1, 1)),
         # a pipeline rounds each micro-batch's gradient apart (and each device's share)
         # (each micro-batch's loss weighted by 1/M in torch, by its share of the batch in JAX)
         ("horovod-torch", "pipeline:1:4", (1, 4, 1 / 4)),
         ("jax-pmap", "pipeline:1:4", (1, 8, 1 / 8)), ("jax-pjit", "pipeline:1:4", (1, 8, 1 / 8)),
         ("horovod-tf", "data", (1, 1)), ("horovod-tf", "sharded:3", (1, 1)),
         ("horovod-tf", "pipeline:1:4", (1, 4, 1 / 4))]
MODEL = toolkit.MLP((64, 128, 10))


def optimizer():
    return toolkit.SGD(lr=0.05, momentum=0.9)


def data():
    return load_digits(seed=0, dtype="float32")[0]


def run(backend, layout, precision, steps=STEPS, x=None, **options):
    x, y = data() if x is None else (x, data()[1])
    trainer = toolkit.Trainer(adapters.get(backend, precision=precision), MODEL, optimizer(),
                              layout=layout, global_batch_size=BATCH, max_steps=steps, seed=0,
                              progress=False, **options)
    return trainer.fit(x, y)


def losses(*args, **options):
    return np.asarray(run(*args, **options).losses)


def rounded_reference(split, steps=STEPS, precision="bf16-mixed", x=None, scaler=None):
    """``split``: ``(ranks, parts)``, or ``(ranks, parts, part_weight)`` (a pipeline)."""
    x, y = data() if x is None else (x, data()[1])
    if scaler is None and precision == "fp16-mixed":
        scaler = LossScaler()
    weight = split[2] if len(split) > 2 else 1.0
    losses, _ = reference_run(MODEL, optimizer(), "cross_entropy", x, y, global_batch_size=BATCH,
                              steps=steps, seed=0, dtype="float32", compute=COMPUTE[precision],
                              split=split[:2], part_weight=weight, scaler=scaler)
    return np.asarray(losses)


def deviation(a, b):
    return np.abs(a - b) / np.abs(b)


@pytest.mark.parametrize("backend, layout, split, precision",
                         [(*case, precision) for precision in BOUNDS for case in CASES])
def test_mixed_is_the_rounded_arithmetic_and_float32_is_not(backend, layout, split, precision):
    early, late = BOUNDS[precision]
    ref = rounded_reference(split, precision=precision)
    mixed = losses(backend, layout, precision)
    assert deviation(mixed[:EARLY], ref[:EARLY]).max() <= early, deviation(mixed, ref)
    assert deviation(mixed, ref).max() <= late, deviation(mixed, ref)
    # a run that silently computed in float32 fails the bound (here: the float32 run itself)
    plain = losses(backend, layout, "32", steps=EARLY)
    assert deviation(plain, ref[:EARLY]).max() > 5 * early, deviation(plain, ref)
    # and the narrow arithmetic trains as float32 does
    assert abs(mixed[-1] - losses(backend, layout, "32")[-1]) <= 0.01 * abs(mixed[-1])


class RecordingScaler(LossScaler):
    """The reference's scaler, noting the steps it skipped."""

    def __init__(self):
        super().__init__()
        self.steps, self.overflows = 0, []

    def update(self, finite: bool) -> None:
        self.steps += 1
        if not finite:
            self.overflows.append(self.steps)
        super().update(finite)


@pytest.mark.parametrize("backend, layout, split", [
    c for c in CASES if c[:2] in {("horovod-torch", "data"), ("horovod-torch", "sharded:3"),
                                  ("jax-pmap", "data"), ("jax-pmap", "sharded:3"),
                                  ("horovod-torch", "pipeline:1:4"),
                                  ("jax-pjit", "pipeline:1:4")}])
def test_the_loss_scaler_skips_and_halves_where_the_reference_does(backend, layout, split):
    """Inputs 30 times larger make the first scaled gradients overflow float16: the scaler
    skips those steps and halves its scale, as the reference's does, and the divergence guard
    counts none of them."""
    x = data()[0] * 30
    scaler = RecordingScaler()
    rounded_reference(split, steps=12, precision="fp16-mixed", x=x, scaler=scaler)
    history = run(backend, layout, "fp16-mixed", steps=12, x=x, on_nonfinite="skip")
    assert len(scaler.overflows) >= 3 and history.overflow_steps == scaler.overflows
    assert history.loss_scales[0] == 2.0 ** 16 and history.skipped_steps == []
    expected = [2.0 ** 16 / 2 ** sum(o < s for o in scaler.overflows) for s in range(1, 13)]
    assert history.loss_scales == expected


def test_the_scaler_state_is_checkpointed_and_a_resume_is_bit_for_bit(tmp_path):
    x = data()[0] * 30  # (overflows before and after the checkpoint)
    whole = run("horovod-torch", "data", "fp16-mixed", steps=12, x=x)
    run("horovod-torch", "data", "fp16-mixed", steps=6, x=x, checkpoint_dir=tmp_path,
        checkpoint_every=6)
    state = toolkit.CheckpointStore(tmp_path).load("latest")
    assert state.step == 6 and float(state.tensors["scaler/scale"]) == whole.loss_scales[6]
    resumed = run("horovod-torch", "data", "fp16-mixed", steps=12, x=x,
                  checkpoint_dir=tmp_path, resume="latest")
    assert resumed.losses == whole.losses[6:] and resumed.loss_scales == whole.loss_scales[6:]


def test_the_reference_rounds_only_under_mixed_precision():
    x, y = data()
    params = MODEL.init(0, "float32")
    first = next(iter(toolkit.GlobalBatchSampler(len(x), BATCH, seed=0)))  # the runs' first
    exact = MODEL.loss_and_grads(params, x[first], y[first])
    rounded = MODEL.loss_and_grads(params, x[first], y[first], compute="bfloat16")
    assert exact[0] != rounded[0] and abs(exact[0] - rounded[0]) < 1e-2 * exact[0]
    assert all(g.dtype == np.float32 for g in rounded[1].values())
    # one shard is the batch itself
    one, _ = reference_run(MODEL, optimizer(), "cross_entropy", x, y, global_batch_size=BATCH,
                           steps=2, seed=0, dtype="float32", compute="bfloat16")
    assert one[0] == pytest.approx(rounded[0], rel=1e-12)


@pytest.mark.parametrize("backend, layout", [
    ("horovod-torch", "data"), ("horovod-torch", "sharded:3"),
    pytest.param("jax-pmap", "data", marks=pytest.mark.long),  # (jax-pmap: sharded:3 below)
    pytest.param("jax-pmap", "sharded:2", marks=pytest.mark.long),
    ("jax-pjit", "data"), ("jax-pjit", "sharded:3:tp2"),
    ("horovod-torch", "pipeline:1:2"), ("jax-pjit", "pipeline:1:2"), ("horovod-tf", "data"),
    ("horovod-tf", "sharded:2"), ("jax-pmap", "sharded:3")])
def test_a_gpt_trains_in_bf16_mixed_as_in_float32(backend, layout):
    """The GPT (layer norms and softmax in float32, the rest in bfloat16) follows the float32
    run's losses within a percent over its first steps, and holds float32 parameters."""
    from toolkit.equivalence import load_data, make_model

    x, y = load_data("gpt", "float32")
    losses = {}
    for precision in ("32", "bf16-mixed"):
        adapter = adapters.get(backend, precision=precision)
        trainer = toolkit.Trainer(adapter, make_model("gpt"), toolkit.Adam(lr=3e-3),
                                  layout=layout, global_batch_size=8, max_steps=6, seed=0,
                                  progress=False)
        losses[precision] = np.asarray(trainer.fit(x, y).losses)
        assert all(v.dtype == np.float32 for k, v in adapter.state_dict().items()
                   if k.startswith("params/"))
    assert deviation(losses["bf16-mixed"], losses["32"]).max() < 1e-2, losses
    assert deviation(losses["bf16-mixed"], losses["32"]).max() > 1e-6, losses  # it rounded


@pytest.mark.parametrize("layout", ["data", "sharded:3"])
def test_the_memory_estimate_of_bf16_mixed_is_what_the_rank_holds(layout):
    """bf16-mixed keeps float32 parameters, gradients and Adam moments (cast on the fly):
    ``python -m toolkit.memory --precision bf16-mixed`` counts those bytes."""
    from toolkit.memory import estimate

    x, y = data()
    adapter = adapters.get("horovod-torch", precision="bf16-mixed")
    toolkit.Trainer(adapter, MODEL, toolkit.Adam(lr=1e-3), layout=layout, global_batch_size=BATCH,
                    max_steps=2, progress=False).fit(x, y)
    held = adapter.memory_bytes()
    count = sum(a.size for a in MODEL.init(0).values())
    est = estimate(count, toolkit.parse_layout(layout), 1, "bf16-mixed", "adam")
    assert (held["params"], held["grads"]) == (est.params, est.grads)
    # (torch.optim's Adam also keeps a float32 step count per tensor: 4 tensors, 16 bytes)
    assert held["optimizer"] - est.optimizer in (0, 4 * len(MODEL.init(0))), held
    assert est.model_states == estimate(count, toolkit.parse_layout(layout), 1,
                                        "float32", "adam").model_states


@pytest.mark.parametrize("backend", ["horovod-torch", "horovod-tf"])
def test_fp16_gradient_compression_rounds_the_allreduce_and_only_where_it_can(backend, launch):
    """Horovod's ``Compression.fp16`` under data parallelism on two ranks: the gradients reach
    the update rounded to float16, so the losses move a little (measured in
    docs/precision.md); a layout that reduces otherwise refuses it."""
    final = {}
    for compression in ("none", "fp16"):
        job = launch("mpirun", 2, ["examples/train_digits.py", "--backend", backend,
                                   "--steps", "20", "--compression", compression])
        assert job.returncode == 0, job
        final[compression] = float(job.stdout.split("final_loss ")[1].split()[0])
    assert 0 < abs(final["fp16"] - final["none"]) < 1e-4 * final["none"], final
    x, y = data()
    with pytest.raises(ToolkitError, match="does not compress gradients under sharded:3"):
        toolkit.Trainer(adapters.get(backend, compression="fp16"), MODEL, optimizer(),
                        layout="sharded:3", global_batch_size=BATCH, max_steps=1,
                        progress=False).fit(x, y)


def test_compression_is_a_horovod_option():
    with pytest.raises(ToolkitError, match="compression='fp16' applies to the Horovod backends"):
        adapters.get("jax-pjit", compression="fp16")
    with pytest.raises(ToolkitError, match="unknown compression 'int8'"):
        adapters.get("horovod-torch", compression="int8")


def _native_model(backend):
    """The digits MLP as the framework's own model (bring your own)."""
    if backend == "horovod-torch":
        import torch

        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                   torch.nn.Linear(128, 10))
    if backend == "horovod-tf":
        import keras

        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                                 keras.layers.Dense(10)])
    import flax.linen as nn
    import jax

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(10)(nn.relu(nn.Dense(128)(x)))

    return Net(), Net().init(jax.random.PRNGKey(0), np.zeros((1, 64), np.float32))


@pytest.mark.parametrize("backend", ["horovod-torch", "jax-pmap", "jax-pjit"])
def test_a_native_model_trains_in_bf16_mixed_as_in_float32(backend):
    """Bring your own: a torch module under autocast, a Flax module with its parameters and
    inputs cast; float32 parameters kept, the losses within a percent of float32's, and not
    float32's own (it rounded)."""
    x, y = data()
    losses = {}
    for precision in ("32", "bf16-mixed"):
        adapter = adapters.get(backend, precision=precision)
        trainer = toolkit.Trainer(adapter, _native_model(backend), optimizer(),
                                  global_batch_size=BATCH, max_steps=10, seed=0, progress=False)
        losses[precision] = np.asarray(trainer.fit(x, y).losses)
        assert all(v.dtype == np.float32 for k, v in adapter.state_dict().items()
                   if k.startswith("params/"))
    assert deviation(losses["bf16-mixed"], losses["32"]).max() < 1e-2, losses
    assert deviation(losses["bf16-mixed"], losses["32"]).max() > 1e-6, losses


@pytest.mark.parametrize("layout", ["data", "pipeline:1:4"])
def test_a_keras_model_runs_the_toolkits_precision_through_its_layers_policies(layout):
    """A Keras model under --precision bf16-mixed computes as Keras' mixed_bfloat16 policy
    (set on its layers; float32 variables), within a percent of float32 and not float32 itself;
    the start-up block says so."""
    x, y = data()
    losses = {}
    for precision in ("32", "bf16-mixed"):
        model = _native_model("horovod-tf")
        adapter = adapters.get("horovod-tf", precision=precision)
        trainer = toolkit.Trainer(adapter, model, optimizer(), layout=layout,
                                  global_batch_size=BATCH, max_steps=10, seed=0, progress=False)
        losses[precision] = np.asarray(trainer.fit(x, y).losses)
        assert {layer.dtype_policy.name for layer in model.layers} == \
            {"32": {"float32"}, "bf16-mixed": {"mixed_bfloat16"}}[precision]
        assert all(v.dtype == np.float32 for k, v in adapter.state_dict().items()
                   if k.startswith("params/"))
    assert deviation(losses["bf16-mixed"], losses["32"]).max() < 1e-2, losses
    assert deviation(losses["bf16-mixed"], losses["32"]).max() > 1e-6, losses


def test_a_keras_model_in_fp16_mixed_has_the_toolkits_loss_scaler():
    """mixed_float16 layers, the toolkit's scaler: a first scale of 2**24 overflows float16,
    the first steps are skipped and the scale halved until it fits (and again at any later
    overflow); the clean steps then train as float32's do."""
    x, y = data()
    steps = 30
    history = toolkit.Trainer(
        adapters.get("horovod-tf", precision="fp16-mixed"), _native_model("horovod-tf"),
        optimizer(), global_batch_size=BATCH, max_steps=steps, seed=0, progress=False,
        init_scale=2 ** 24).fit(x, y)
    overflows = history.overflow_steps
    first = next(s for s in range(1, steps + 1) if s not in overflows) - 1
    assert first >= 1 and overflows[:first] == list(range(1, first + 1)), overflows
    assert history.loss_scales == [2.0 ** 24 / 2 ** sum(o < s for o in overflows)
                                   for s in range(1, steps + 1)]
    assert history.losses[-1] < history.losses[first] - 0.5  # (trains once the scale fits)
    # the skipped steps changed nothing: after them the parameters are the initial ones
    model = _native_model("horovod-tf")
    initial = [v.numpy().copy() for v in model.trainable_variables]
    toolkit.Trainer(adapters.get("horovod-tf", precision="fp16-mixed"), model, optimizer(),
                    global_batch_size=BATCH, max_steps=first, seed=0, progress=False,
                    init_scale=2 ** 24).fit(x, y)
    assert all(np.array_equal(v.numpy(), before)
               for v, before in zip(model.trainable_variables, initial, strict=True))


def test_a_keras_model_built_under_a_mixed_policy_needs_that_precision():
    import keras

    x, y = data()
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        model = _native_model("horovod-tf")
    finally:
        keras.mixed_precision.set_global_policy("float32")
    refused = toolkit.Trainer(adapters.get("horovod-tf"), model, optimizer(),
                              global_batch_size=BATCH, max_steps=1, progress=False)
    with pytest.raises(ToolkitError, match="built under the mixed precision policy "
                                           "'mixed_bfloat16', but horovod-tf runs precision "
                                           "'32'") as err:
        refused.fit(x, y)
    assert "--precision bf16-mixed" in err.value.hint
    with pytest.raises(ToolkitError, match="'mixed_bfloat16', but horovod-tf runs precision "
                                           "'fp16-mixed'"):
        toolkit.Trainer(adapters.get("horovod-tf", precision="fp16-mixed"), model, optimizer(),
                        global_batch_size=BATCH, max_steps=1, progress=False).fit(x, y)
    history = toolkit.Trainer(adapters.get("horovod-tf", precision="bf16-mixed"), model,
                              optimizer(), global_batch_size=BATCH, max_steps=3,
                              progress=False).fit(x, y)
    assert len(history.losses) == 3 and np.isfinite(history.losses).all()
