"""Checkpoints export to each framework's own format, and load back there unchanged."""

import numpy as np
import pytest

import adapters
import toolkit
from adapters import export
from toolkit.datasets import load_digits


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("export")
    (x, y), _ = load_digits()
    toolkit.Trainer(adapters.get("horovod-torch"), toolkit.CNN((8, 8, 1), (4,), 10),
                    toolkit.SGD(lr=0.1), global_batch_size=32, max_steps=3, progress=False,
                    checkpoint_dir=tmp / "ckpt", env=toolkit.LaunchEnv()).fit(
        x.reshape(-1, 8, 8, 1), y)
    return tmp, toolkit.CheckpointStore(tmp / "ckpt").load("latest")


def test_torch_state_dict_loads_into_the_module_and_computes_the_same(checkpoint):
    import torch

    tmp, ckpt = checkpoint
    export.main([str(tmp / "ckpt"), "--format", "torch", "--out", str(tmp / "model.pt")])
    spec = toolkit.CNN((8, 8, 1), (4,), 10)
    net = export.torch_module(spec)  # the public builder
    net.load_state_dict(torch.load(tmp / "model.pt"))
    x = np.random.default_rng(0).normal(size=(5, 8, 8, 1)).astype(np.float32)
    weights = export.weights(ckpt)
    with torch.no_grad():
        np.testing.assert_allclose(net(torch.from_numpy(x)).numpy(), spec.apply(weights, x),
                                   rtol=1e-5, atol=1e-6)


def test_tf_checkpoint_restores_the_weights(checkpoint):
    import tensorflow as tf

    tmp, ckpt = checkpoint
    export.main([str(ckpt.path), "--format", "tf", "--out", str(tmp / "tf" / "model")])
    weights = export.weights(ckpt)
    restored = {k: tf.Variable(tf.zeros_like(v)) for k, v in weights.items()}
    tf.train.Checkpoint(params=restored).read(str(tmp / "tf" / "model")).assert_consumed()
    for k, v in weights.items():
        np.testing.assert_array_equal(restored[k].numpy(), v)


def test_orbax_checkpoint_restores_the_flax_tree(checkpoint):
    import orbax.checkpoint as ocp

    tmp, ckpt = checkpoint
    export.main([str(tmp / "ckpt"), "--format", "orbax", "--out", str(tmp / "orbax")])
    tree = ocp.PyTreeCheckpointer().restore((tmp / "orbax").resolve())
    weights = export.weights(ckpt)
    assert sorted(tree) == ["convs_0", "head"]
    restored = {f"{a.replace('_', '.')}.{b}": v for a, leaves in tree.items()
                for b, v in leaves.items()}
    assert restored.keys() == weights.keys() and len(weights) == 4
    for name, value in weights.items():
        np.testing.assert_array_equal(restored[name], value, err_msg=name)


@pytest.fixture(scope="module")
def gpt_checkpoint(tmp_path_factory):
    from toolkit.equivalence import load_data

    tmp = tmp_path_factory.mktemp("export-gpt")
    x, y = load_data("gpt", "float32")
    spec = toolkit.GPT(vocab=256, context=16, width=32, layers=2, heads=2)
    toolkit.Trainer(adapters.get("horovod-torch"), spec, toolkit.Adam(lr=1e-2),
                    global_batch_size=16, max_steps=3, progress=False,
                    checkpoint_dir=tmp / "ckpt", env=toolkit.LaunchEnv()).fit(x[:256], y[:256])
    return tmp, spec, toolkit.CheckpointStore(tmp / "ckpt").load("latest"), x[:4]


def test_torch_export_of_the_gpt_loads_into_a_plain_module_with_the_toolkits_logits(
        gpt_checkpoint):
    """``torch_module(spec).load_state_dict(torch.load(path))`` works, strictly, and the
    module's logits are those of the toolkit's evaluation of the same checkpoint."""
    import torch

    tmp, spec, ckpt, x = gpt_checkpoint
    export.main([str(tmp / "ckpt"), "--format", "torch", "--out", str(tmp / "gpt.pt")])
    net = export.torch_module(spec)
    net.load_state_dict(torch.load(tmp / "gpt.pt"), strict=True)
    assert net.state_dict()["blocks.0.attn.qkv.kernel"].shape == (32, 96)  # (in, out)
    with torch.no_grad():
        logits = net(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(logits, spec.apply(export.weights(ckpt), x), rtol=1e-4,
                               atol=1e-5)


def test_orbax_export_of_the_gpt_runs_in_flax_as_the_toolkit_does(gpt_checkpoint):
    """Every array restored, and the Flax GPT built from the restored tree gives the logits of
    the toolkit's own numpy GPT on the checkpoint's weights."""
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    from adapters._jax.models.gpt import FlaxGPT, from_tree

    tmp, spec, ckpt, x = gpt_checkpoint
    export.main([str(tmp / "ckpt"), "--format", "orbax", "--out", str(tmp / "orbax")])
    tree = ocp.PyTreeCheckpointer().restore((tmp / "orbax").resolve())
    weights = export.weights(ckpt)
    restored = from_tree(tree)
    assert restored.keys() == weights.keys()
    for name, value in weights.items():
        np.testing.assert_array_equal(np.asarray(restored[name]), value, err_msg=name)
    logits = FlaxGPT(spec).apply({"params": tree}, jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(logits), spec.apply(weights, x), rtol=1e-4,
                               atol=1e-5)
