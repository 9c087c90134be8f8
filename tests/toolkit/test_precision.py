"""The precision policies (``toolkit.precision``) and how a backend holds and checks one."""

from __future__ import annotations

import pytest

import adapters
from toolkit import ToolkitError
from toolkit.precision import PRECISIONS, Precision


@pytest.mark.parametrize("name, param, compute, scaled", [
    ("32", "float32", "float32", False), ("64", "float64", "float64", False),
    ("bf16-mixed", "float32", "bfloat16", False), ("fp16-mixed", "float32", "float16", True)])
def test_each_policy_says_its_dtypes(name, param, compute, scaled):
    p = Precision.of(name)
    assert (p.param_dtype, p.compute_dtype, p.loss_scaling) == (param, compute, scaled)
    assert p.mixed == (compute != param) and name in PRECISIONS


def test_a_dtype_gives_its_plain_policy_and_a_contradiction_is_refused():
    assert Precision.of(None).name == "32" and Precision.of(None, "float64").name == "64"
    assert Precision.of("bf16-mixed", "float32").compute_dtype == "bfloat16"
    with pytest.raises(ToolkitError, match="precision '64' keeps its parameters in float64, "
                                           "but dtype 'float32'") as err:
        Precision.of("64", "float32")
    assert "use precision '32' for float32" in err.value.hint
    with pytest.raises(ToolkitError, match="unknown precision 'bf16'") as err:
        Precision.of("bf16")
    assert "bf16-mixed" in err.value.hint


def test_a_backend_hands_its_policy_to_the_strategy():
    import toolkit

    adapter = adapters.get("horovod-torch", precision="64")
    assert adapter.dtype_name == "float64" and adapter.precision.name == "64"
    adapter = adapters.get("horovod-torch")
    assert adapter.precision.name == "32"
    with pytest.raises(ToolkitError, match="this horovod-torch backend was made for float32"):
        adapter.precision = "64"
    adapter.setup(toolkit.current_env())  # (Horovod stays started for the process)
    made = adapter.strategy  # made with the backend's policy, in its family's plugin
    assert made.precision.policy is adapter.precision
    assert type(made.precision).__name__ == "TorchPrecision"
    adapter.precision = "bf16-mixed"  # set after setup: the strategy is never changed live,
    assert made.precision.name == "32"  # the build makes a fresh one for the new policy
    adapter.build(toolkit.MLP((4, 3)), toolkit.SGD(lr=0.1), "cross_entropy")
    assert adapter.strategy is not made and adapter.strategy.precision.name == "bf16-mixed"


def _digits_run(adapter, **options):
    import toolkit
    from toolkit.datasets import load_digits

    (x, y), _ = load_digits(seed=0, dtype=adapter.dtype_name)
    trainer = toolkit.Trainer(adapter, toolkit.MLP((64, 16, 10)), toolkit.SGD(lr=0.1),
                              global_batch_size=32, max_steps=3, progress=False, **options)
    return trainer, trainer.fit(x, y)


def test_precision_64_is_the_float64_run_and_the_start_says_it(capsys):
    by_precision, history = _digits_run(adapters.get("horovod-torch", precision="64"))
    assert by_precision.precision.name == "64"
    assert "horovod-torch, float64" in capsys.readouterr().out
    _, by_dtype = _digits_run(adapters.get("horovod-torch", dtype="float64"))
    assert history.losses == by_dtype.losses and len(history.losses) == 3


def test_the_trainer_refuses_a_precision_its_backend_cannot_hold():
    import toolkit

    with pytest.raises(ToolkitError, match="made for float32 parameters") as err:
        toolkit.Trainer(adapters.get("jax-pjit"), toolkit.MLP((4, 2)), toolkit.SGD(lr=0.1),
                        precision="64", global_batch_size=8)
    assert "adapters.get('jax-pjit', precision='64')" in err.value.hint


def test_the_loss_scalers_settings_are_checked_and_set_only_where_the_loss_is_scaled():
    fp16 = Precision.of("fp16-mixed")
    assert (fp16.init_scale, fp16.growth_interval) == (2.0 ** 16, 2000)  # torch's defaults
    set_ = fp16.with_scaling(init_scale=2 ** 10, growth_interval=7)
    scaler = set_.scaler()
    assert (scaler.scale, scaler.growth_interval) == (1024.0, 7)
    assert set_.scaling_settings() == {"init_scale": 1024.0, "growth_interval": 7}
    assert Precision.of("bf16-mixed").scaler() is None
    assert Precision.of("bf16-mixed").scaling_settings() is None
    with pytest.raises(ToolkitError, match=r"init_scale 1000 is not a positive power of two"
                                           r"[\s\S]*512 or 1024"):
        fp16.with_scaling(init_scale=1000)
    for bad in (0, -4.0, float("inf"), float("nan")):
        with pytest.raises(ToolkitError, match="not a positive power of two"):
            fp16.with_scaling(init_scale=bad)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ToolkitError, match=f"growth_interval {bad!r} is not a whole"):
            fp16.with_scaling(growth_interval=bad)
    with pytest.raises(ToolkitError, match="'bf16-mixed' does not scale the loss"):
        Precision.of("bf16-mixed").with_scaling(init_scale=1024)


def test_the_cli_options_reach_the_trainers_keywords():
    import argparse

    from toolkit import add_trainer_options, trainer_options

    parser = add_trainer_options(argparse.ArgumentParser())
    options = trainer_options(parser.parse_args(
        ["--precision", "fp16-mixed", "--init-scale", "256", "--growth-interval", "3"]))
    assert (options["precision"], options["init_scale"], options["growth_interval"]) == \
        ("fp16-mixed", 256.0, 3)
