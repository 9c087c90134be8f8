"""The user's own torch.optim optimizer and LR scheduler under every horovod-torch layout
(adapters/horovod_torch/torch_optim.py): equal to data parallelism, resumed across layouts,
and the optimizers that are not elementwise refused by name."""

import numpy as np
import pytest

import adapters
import toolkit
from toolkit import MLP, LaunchEnv, ToolkitError
from toolkit.datasets import load_digits

WORKER = "tests/scripts/native_optimizer_worker.py"
# (the pipelines first: their Horovod process sets are made when Horovod starts)
LAYOUTS = ["pipeline:2:2", "pipeline:2:4:1f1b", "sharded:1", "sharded:2", "sharded:3"]


def losses_of(job) -> dict[str, tuple[int, np.ndarray]]:
    assert job.returncode == 0, job
    return {r["layout"]: (r["start"], np.asarray(r["losses"])) for r in job.results}


@pytest.fixture(scope="module")
def reference(request) -> np.ndarray:
    """AdamW + OneCycleLR, data parallel on one process: 20 steps."""
    launch = request.getfixturevalue("launch")
    return losses_of(launch("python", 1, [WORKER, "horovod-torch", "20", "data"]))["data"][1]


def test_adamw_with_onecycle_under_every_layout_equals_data_parallel(launch, reference):
    """On 4 ranks (the pipelines with 2 replicas), float64, clipped: within 1e-12 of one
    process's data parallel for 20 steps."""
    got = losses_of(launch("any", 4, [WORKER, "horovod-torch", "20", *LAYOUTS, "data"]))
    assert sorted(got) == sorted(["data", *LAYOUTS])
    assert abs(reference[-1] - reference[0]) > 0.5  # it trains: the schedule matters
    for layout, (start, losses) in got.items():
        assert start == 0 and len(losses) == 20, layout
        np.testing.assert_allclose(losses, reference, rtol=0, atol=1e-12, err_msg=layout)


def test_a_run_resumes_across_layouts_with_its_optimizer_and_schedule(launch, tmp_path,
                                                                     reference):
    """sharded:3 on 2 ranks for 10 steps -> a pipeline on 2 ranks to step 15 -> data parallel
    on one process to step 20: AdamW's moments, its step count and OneCycleLR's position
    travel in the neutral checkpoint, so the losses are those of the uninterrupted run."""
    ckpt = ["--checkpoint-dir", str(tmp_path)]
    first = losses_of(launch("any", 2, [WORKER, "horovod-torch", "20", "sharded:3", *ckpt,
                                        "--stop-after", "10"]))["sharded:3"]
    second = losses_of(launch("any", 2, [WORKER, "horovod-torch", "20", "pipeline:2:1", *ckpt,
                                         "--stop-after", "15", "--resume"]))["pipeline:2:1"]
    third = losses_of(launch("python", 1, [WORKER, "horovod-torch", "20", "data", *ckpt,
                                           "--resume"]))["data"]
    assert (first[0], second[0], third[0]) == (0, 10, 15)
    resumed = np.concatenate([first[1], second[1], third[1]])
    np.testing.assert_allclose(resumed, reference, rtol=0, atol=1e-12)


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
