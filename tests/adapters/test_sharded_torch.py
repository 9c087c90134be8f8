"""horovod-torch's sharded layouts (ZeRO 1-3 / FSDP): its collectives against numpy under
Gloo and MPI, per-rank bytes against the flat-shard arithmetic, checkpoint pieces, bad input.

The equivalence of every stage with the reference is tests/test_sharded.py's (all backends).
"""


import numpy as np
import pytest

import adapters
import toolkit
from toolkit import MLP, SGD, Adam, LaunchEnv, Sharded, ToolkitError
from toolkit.datasets import load_digits

WORKER = "tests/scripts/sharded_torch_worker.py"


def results(job) -> list[dict]:
    assert job.returncode == 0, job
    rows = sorted(job.results, key=lambda r: r["rank"])
    assert len(rows) == 3, job
    return rows


def train(model, optimizer, layout, steps=10):
    (x, y), _ = load_digits()
    trainer = toolkit.Trainer(adapters.get("horovod-torch"), model, optimizer, layout=layout,
                              global_batch_size=32, max_steps=steps, progress=False,
                              env=LaunchEnv())
    return trainer.fit(x, y).losses, trainer


def test_tensor_parallel_is_refused():
    with pytest.raises(ToolkitError, match="only jax-pjit splits layers"):
        adapters.get("horovod-torch").setup(LaunchEnv(), Sharded(stage=3, tensor_parallel=2))
    with pytest.raises(ToolkitError, match="tensor_parallel=2"):
        train(MLP((64, 10)), SGD(lr=0.1), "sharded:3:tp2", steps=1)


def test_a_native_module_shards_like_the_spec():
    """A torch Sequential with the spec's weights trains under FSDP as the spec does (units:
    its top-level children, names: torch's), and its checkpoint names are torch's."""
    import torch

    spec = MLP((64, 32, 10))
    params = spec.init(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    with torch.no_grad():
        for i, layer in enumerate((net[0], net[2])):
            layer.weight.copy_(torch.from_numpy(params[f"layers.{i}.kernel"].T.copy()))
            layer.bias.copy_(torch.from_numpy(params[f"layers.{i}.bias"]))
    optimizer = SGD(lr=0.1, momentum=0.9)
    native, trainer = train(net, optimizer, "sharded:3")
    spec_losses, _ = train(spec, optimizer, None)
    np.testing.assert_allclose(native, spec_losses, rtol=1e-6)
    state = trainer.adapter.state_dict()
    assert {"params/0.weight", "opt/momentum/2.bias", "rng/step"} <= set(state)
    assert not list(net.parameters())  # the flat shards hold the state now


def test_what_cannot_be_sharded_is_refused_clearly():
    import torch

    with pytest.raises(ToolkitError, match="(?s)recurrent module 'rnn'.*units are the module's"):
        net = torch.nn.Module()
        net.rnn = torch.nn.GRU(4, 4)
        train(net, SGD(lr=0.1), "sharded:2", steps=1)
    net = torch.nn.Sequential(torch.nn.Linear(64, 10))
    with pytest.raises(ToolkitError, match="(?s)cannot use the optimizer LBFGS.*toolkit.SGD"):
        train(net, torch.optim.LBFGS(net.parameters(), lr=0.1), "sharded:1", steps=1)
    net[0].bias.requires_grad_(False)
    with pytest.raises(ToolkitError, match="frozen parameters \\('0.bias'\\)"):
        train(net, Adam(lr=0.1), "sharded:1", steps=1)


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["horovodrun-gloo", "horovodrun-mpi"])
def test_collectives_match_numpy_with_large_chunks(launcher, launch):
    """Reduce-scatter and all-gather (plain, grouped, and the FSDP autograd function) with
    more than 1 MiB per rank over 3 ranks (a corruption of large chunks was reported for Gloo's
    reduce-scatter)."""
    for row in results(launch(launcher, 3, [WORKER, "collectives"])):
        assert {"reducescatter.float32", "grouped_allgather.1",
                "fsdp.reducescatter_backward"} <= set(row)


@pytest.mark.long
@pytest.mark.slow
def test_stages_train_alike_hold_their_shards_and_checkpoint_pieces(launch):
    """Data parallel and stages 1-3 on a GPT over 3 ranks (uneven shards), with accumulation,
    a custom loss and metric: equal losses, evaluation and state; memory_bytes() equals the
    flat-shard arithmetic; stage 3's checkpoint pieces read back as the full state."""
    rows = results(launch("any", 3, [WORKER, "layouts"], timeout=400))
    memory = rows[0]["memory"]
    dp, zero3 = sum(memory["data_parallel"].values()), sum(memory["sharded:3"].values())
    assert zero3 < 0.4 * dp, memory
    assert memory["sharded:1"]["optimizer"] < 0.4 * memory["data_parallel"]["optimizer"]
