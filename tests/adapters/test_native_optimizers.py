"""The framework's own optimizer and LR schedule under sharded and pipeline layouts: torch.optim
optimizers with a torch LR scheduler in horovod-torch (adapters/horovod_torch/torch_optim.py),
Keras optimizers with a LearningRateSchedule in horovod-tf (adapters/horovod_tf/keras_optim.py:
a Keras model pipelined, the spec MLP sharded and pipelined): equal to data parallelism,
resumed across layouts, and the optimizers that are not elementwise refused by name."""

import numpy as np
import pytest

import adapters
import toolkit
from toolkit import MLP, LaunchEnv, ToolkitError
from toolkit.datasets import load_digits

WORKER = "tests/scripts/native_optimizer_worker.py"
# case -> (the worker's backend and flags, the layouts it runs a native optimizer under, two
# layouts a run is moved through before data parallelism). The pipelines come first: their
# Horovod process sets are made when Horovod starts. "-spec": the toolkit's small GPT, whose
# tied embedding sits on the first and last stage (torch: the optimizer as a function of the
# parameters; horovod-tf shards the spec models only).
# pipeline x ZeRO-3, a replica's stages on neighbouring ranks (the pipelines' process sets)
PIPELINE_ZERO = "pipeline:2:2+sharded:3+place:tensor:pipeline:data:replicate"
CASES = {
    "horovod-torch": (["horovod-torch"], ["pipeline:2:2", "pipeline:2:4:1f1b", PIPELINE_ZERO,
                                          "sharded:1", "sharded:2", "sharded:3"],
                      ("sharded:3", "pipeline:2:1")),
    "horovod-tf": (["horovod-tf"], ["pipeline:2:2", "pipeline:2:4:1f1b"],
                   ("pipeline:2:1", "pipeline:2:2")),
    "horovod-tf-spec": (["horovod-tf", "--spec"], ["pipeline:2:2", "sharded:1", "sharded:2",
                                                   "sharded:3"], ("sharded:3", "pipeline:2:1")),
    "horovod-torch-spec": (["horovod-torch", "--spec"], ["pipeline:2:2", PIPELINE_ZERO,
                                                         "sharded:1", "sharded:3"],
                           ("sharded:2", "pipeline:2:1")),
    "horovod-torch-32": (["horovod-torch", "--precision", "32"],
                         ["pipeline:2:4:1f1b", "sharded:2", "sharded:3"], None),
    "horovod-tf-32": (["horovod-tf", "--precision", "32"], ["pipeline:2:2"], None),
}
# Relative bounds over 20 steps in float64 (float32: 1e-6). The MLPs: 1e-12. The GPT: the pipeline
# adds up its micro-batches (and compiles its pieces) in another order, and AdamW divides each
# element's moment by the root of its own second moment, so the rounding of the tiny gradients of
# bytes the batches barely hold grows step by step (measured: torch 2.3e-12, Keras 2.0e-9).
TOLERANCE = {"horovod-torch": 1e-12, "horovod-tf": 1e-12, "horovod-torch-spec": 1e-10,
             "horovod-tf-spec": 1e-8, "horovod-torch-32": 1e-6, "horovod-tf-32": 1e-6}
# The slowest cases run with `make test-long` (the suite keeps within its time): the GPTs of
# horovod-tf and horovod-torch (the MLPs under the same layouts run in `make test`), and
# horovod-tf's Keras optimizer in float32 (in float64 it runs the same pipelines).
LONG = {"horovod-tf-spec", "horovod-torch-spec", "horovod-tf-32"}
# (the Keras optimizer's resume across layouts with make test-long: make test resumes
# horovod-torch's torch.optim across layouts, and trains the Keras one under every layout)
RESUME_LONG = {"horovod-tf"}
REFERENCES: dict[str, np.ndarray] = {}


def cases(with_resume: bool = False) -> list:
    long = LONG | RESUME_LONG if with_resume else LONG
    return [pytest.param(c, marks=[pytest.mark.long] if c in long else [])
            for c in sorted(CASES) if CASES[c][2] or not with_resume]


def worker(case: str, layouts: list[str], *extra: str) -> list[str]:
    backend, *flags = CASES[case][0]
    return [WORKER, backend, "20", *layouts, *flags, *extra]


def losses_of(job) -> dict[str, tuple[int, np.ndarray]]:
    assert job.returncode == 0, job
    return {r["layout"]: (r["start"], np.asarray(r["losses"])) for r in job.results}


@pytest.fixture
def reference(launch, case) -> np.ndarray:
    """AdamW and its schedule (torch: OneCycleLR; Keras: warmup-cosine), data parallel on one
    process: 20 steps (once per case)."""
    if case not in REFERENCES:
        REFERENCES[case] = losses_of(launch("python", 1, worker(case, ["data"])))["data"][1]
    return REFERENCES[case]


@pytest.mark.slow
@pytest.mark.parametrize("case", cases())
def test_adamw_with_a_schedule_under_every_layout_equals_data_parallel(launch, case,
                                                                      reference):
    """On 4 ranks (the pipelines with 2 replicas), clipped: within TOLERANCE of one process's
    data parallel for 20 steps."""
    layouts = CASES[case][1]
    got = losses_of(launch("any", 4, worker(case, [*layouts, "data"])))
    assert sorted(got) == sorted(["data", *layouts])
    assert abs(reference[-1] - reference[0]) > 0.5  # it trains: the schedule matters
    for layout, (start, losses) in got.items():
        assert start == 0 and len(losses) == 20, layout
        np.testing.assert_allclose(losses, reference, rtol=TOLERANCE[case], err_msg=layout)


@pytest.mark.slow
@pytest.mark.parametrize("case", cases(with_resume=True))
def test_a_run_resumes_across_layouts_with_its_optimizer_and_schedule(launch, tmp_path,
                                                                     case, reference):
    """Two layouts on 2 ranks (sharded:3 for 10 steps, then a pipeline to step 15; a Keras
    model: two pipelines) -> data parallel on one process to step 20: the optimizer's moments,
    its step count and the schedule's position travel in the neutral checkpoint, so the
    losses are those of the uninterrupted run."""
    ckpt = ["--checkpoint-dir", str(tmp_path)]
    one, two = CASES[case][2]
    first = losses_of(launch("any", 2, worker(case, [one], *ckpt, "--stop-after", "10")))[one]
    second = losses_of(launch("any", 2, worker(case, [two], *ckpt, "--stop-after", "15",
                                               "--resume")))[two]
    third = losses_of(launch("python", 1, worker(case, ["data"], *ckpt, "--resume")))["data"]
    assert (first[0], second[0], third[0]) == (0, 10, 15)
    resumed = np.concatenate([first[1], second[1], third[1]])
    np.testing.assert_allclose(resumed, reference, rtol=TOLERANCE[case])


def train(net, optimizer, layout, steps=3):
    (x, y), _ = load_digits()
    trainer = toolkit.Trainer(adapters.get("horovod-torch"), net, optimizer, layout=layout,
                              global_batch_size=32, max_steps=steps, progress=False,
                              env=LaunchEnv())
    return np.asarray(trainer.fit(x, y).losses), trainer


def mlp():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.Tanh(), torch.nn.Linear(16, 10))


@pytest.mark.parametrize("layout", ["sharded:1", "sharded:3", "pipeline:1:2"])
@pytest.mark.parametrize("name", ["LBFGS", "Adafactor", "NAdam", "Rprop"])
def test_an_optimizer_that_is_not_elementwise_is_refused_by_name(name, layout):
    import torch

    net = mlp()
    with pytest.raises(ToolkitError, match=rf"cannot use the optimizer {name}\(.*\): its? ") as err:
        train(net, getattr(torch.optim, name)(net.parameters()), layout)
    assert "torch.optim.AdamW" in err.value.hint and "data-parallel" in err.value.hint


def test_a_subclass_is_refused_and_a_spec_model_needs_its_own_parameters():
    import torch

    class MyAdamW(torch.optim.AdamW):
        pass

    net = mlp()
    with pytest.raises(ToolkitError, match=r"optimizer MyAdamW\(lr=0.001, .*\): it is not one of"):
        train(net, MyAdamW(net.parameters()), "sharded:2")
    with pytest.raises(ToolkitError, match="not the model's parameters"):
        train(MLP((64, 10)), torch.optim.AdamW(net.parameters()), "sharded:2")


@pytest.mark.parametrize("layout", [None, "sharded:2", "pipeline:1:2"])
def test_the_state_an_optimizer_makes_when_built_is_kept(layout):
    """Adagrad fills its sums with initial_accumulator_value when built; every layout starts
    from them (Horovod's DistributedOptimizer rebuilds the optimizer from its defaults: the
    data-parallel layout puts them back)."""
    import torch

    def run(value):
        net = mlp()
        return train(net, torch.optim.Adagrad(net.parameters(), lr=0.1,
                                              initial_accumulator_value=value), layout)

    with_sums, trainer = run(1.0)
    without, _ = run(0.0)
    assert np.abs(with_sums[1:] - without[1:]).max() > 1e-3
    state = trainer.adapter.state_dict()
    assert np.all(state["opt/sum/2.bias"] >= 1.0) and int(state["opt/count"]) == 3


def keras_train(optimizer_of, layout, steps=3, built=False):
    """A Keras Sequential with ``optimizer_of(keras)`` (``built``: over the model's variables
    first) for a few steps on one process."""
    import keras

    adapter = adapters.get("horovod-tf")
    adapter.setup(LaunchEnv())
    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation="tanh"),
                            keras.layers.Dense(10)])
    (x, y), _ = load_digits()
    optimizer = optimizer_of(keras)
    if built:
        optimizer.build(net.trainable_variables)
    trainer = toolkit.Trainer(adapter, net, optimizer, layout=layout,
                              global_batch_size=32, max_steps=steps, progress=False,
                              env=LaunchEnv())
    return np.asarray(trainer.fit(x, y).losses), trainer


@pytest.mark.parametrize(("make", "said"), [
    (lambda k: k.optimizers.Lamb(), r"optimizer Lamb\(.*\): its trust ratio"),
    (lambda k: k.optimizers.Adafactor(), r"optimizer Adafactor\(.*\): it factors"),
    (lambda k: type("MyAdam", (k.optimizers.Adam,), {})(), r"optimizer MyAdam\(.*\): it is"),
    (lambda k: k.optimizers.AdamW(global_clipnorm=1.0), r"with global_clipnorm=1.0: it reads"),
])
def test_a_keras_optimizer_that_is_not_elementwise_is_refused_in_a_pipeline(make, said):
    with pytest.raises(ToolkitError, match=said) as err:
        keras_train(make, "pipeline:1:2")
    assert "keras.optimizers.AdamW" in err.value.hint or "clip_grad_norm" in err.value.hint


def test_a_keras_optimizer_built_before_is_rebuilt_for_the_stage():
    """The user's optimizer built over the whole model (as data parallelism takes it): a
    stage builds a fresh one of its class and settings, schedule included, over its own
    variables; one process's pipeline equals data parallel."""
    def adamw(keras):
        schedule = keras.optimizers.schedules.ExponentialDecay(0.01, 2, 0.5)
        return keras.optimizers.AdamW(learning_rate=schedule, weight_decay=0.01)

    data, _ = keras_train(adamw, None, built=True)
    piped, trainer = keras_train(adamw, "pipeline:1:2", built=True)
    np.testing.assert_allclose(piped, data, rtol=1e-6)
    state = trainer.adapter.state_dict()
    assert int(state["opt/iteration"]) == 3
    assert any(k.startswith("opt/momentum/") for k in state), sorted(state)
