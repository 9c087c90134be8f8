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


def test_export_takes_the_checkpoint_directory_its_latest_and_a_step_directory(checkpoint):
    """``ck``, ``ck/latest`` and ``ck/step_*`` all name a checkpoint (``latest`` is a text
    file naming the newest step directory)."""
    tmp, ckpt = checkpoint
    store = tmp / "ckpt"
    assert (store / "latest").is_file()
    for given in (store, store / "latest", ckpt.path):
        loaded = export.load(given)
        assert (loaded.path, loaded.step) == (ckpt.path, ckpt.step), given
    export.main([str(store / "latest"), "--format", "torch", "--out", str(tmp / "latest.pt")])
    assert (tmp / "latest.pt").stat().st_size > 0


def test_export_of_a_path_without_a_checkpoint_says_what_it_found(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    (tmp_path / "other" / "runs").mkdir()
    (tmp_path / "gone").mkdir()
    (tmp_path / "gone" / "latest").write_text("step_000000020\n")
    found = {"empty": "it is empty", "missing": "it does not exist",
             "other": "it holds notes.txt, runs/",
             "gone/latest": "names step_000000020, and " + str(tmp_path / "gone")}
    for given, said in found.items():
        with pytest.raises(toolkit.ToolkitError) as err:
            export.main([str(tmp_path / given), "--format", "torch", "--out",
                         str(tmp_path / "m.pt")])
        assert f"no checkpoint in {tmp_path / given}" in err.value.message, given
        assert said in err.value.message, (given, err.value.message)
        assert "--resume" not in str(err.value)  # export has no such option
        assert "step_*" in err.value.hint and "--format" in err.value.hint


def test_export_of_a_damaged_step_directory_gives_exports_hint(tmp_path, checkpoint):
    import shutil

    _, ckpt = checkpoint
    shutil.copytree(ckpt.path, tmp_path / ckpt.path.name)
    (tmp_path / ckpt.path.name / "manifest.json").write_text("{")
    with pytest.raises(toolkit.ToolkitError) as err:
        export.load(tmp_path / ckpt.path.name)
    assert "unreadable or truncated" in err.value.message
    assert "--resume" not in str(err.value) and "step_*" in err.value.hint


def test_hf_export_from_latest_has_token_ids_within_the_vocabulary(gpt_checkpoint):
    """GPT-2's default bos/eos ids (50256) lie outside the 256-byte vocabulary and make
    ``from_pretrained`` warn; the export writes none."""
    from transformers import GPT2Config

    tmp, spec, ckpt, _ = gpt_checkpoint
    export.main([str(tmp / "ckpt" / "latest"), "--format", "hf", "--out", str(tmp / "hf")])
    config = GPT2Config.from_pretrained(tmp / "hf", local_files_only=True)
    assert config.vocab_size == spec.vocab == 256
    ids = {name: getattr(config, name) for name in config.to_dict() if name.endswith("_token_id")}
    assert {"bos_token_id", "eos_token_id"} <= ids.keys()
    for name, value in ids.items():
        assert value is None or 0 <= value < spec.vocab, (name, value)
