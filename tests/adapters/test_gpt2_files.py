"""The toolkit's GPT as Hugging Face's GPT2LMHeadModel and back (offline, a tiny random GPT)."""

import numpy as np
import pytest

import adapters
import toolkit
from adapters import export
from toolkit.models.gpt2_files import save_pretrained

SPEC = toolkit.GPT(vocab=64, context=16, width=32, layers=2, heads=4)


def tokens(n=3, t=12, seed=0):
    return np.random.default_rng(seed).integers(0, SPEC.vocab, (n, t))


@pytest.mark.parametrize("tied", [True, False])
def test_gpt2lmheadmodel_loads_the_export_and_gives_the_toolkits_logits(tmp_path, tied):
    import torch
    from transformers import GPT2LMHeadModel

    spec = toolkit.GPT(vocab=64, context=16, width=32, layers=2, heads=4, tied=tied)
    params = spec.init(3)
    save_pretrained(spec, params, tmp_path / "gpt2")
    model = GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2", local_files_only=True)
    model.eval()
    x = tokens()
    with torch.no_grad():
        logits = model(torch.from_numpy(x)).logits.numpy()
    np.testing.assert_allclose(logits, spec.apply(params, x), rtol=1e-4, atol=2e-5)
    assert (model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()) == tied


def test_a_gpt2_directory_saved_by_transformers_is_a_gpt_to_fine_tune(tmp_path):
    """The reverse: GPT2LMHeadModel.save_pretrained's directory -> toolkit.GPT.from_pretrained,
    whose init returns its weights; trained a few steps on jax-pjit, it starts from GPT-2's
    loss."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    hf = GPT2LMHeadModel(cfg).eval()
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    spec = toolkit.GPT.from_pretrained(tmp_path / "hf")
    assert (spec.vocab, spec.context, spec.width, spec.layers, spec.heads, spec.tied) == (
        64, 16, 32, 2, 4, True)
    params = spec.init(seed=123)  # the directory's weights, whatever the seed
    assert np.array_equal(params["tok_emb"], hf.transformer.wte.weight.detach().numpy())
    x = tokens(4, 16)
    with torch.no_grad():
        want = hf(torch.from_numpy(x)).logits.numpy()
    np.testing.assert_allclose(spec.apply(params, x), want, rtol=1e-4, atol=2e-5)
    y = np.roll(x, -1, axis=1)
    trainer = toolkit.Trainer(adapters.get("jax-pjit"), spec, toolkit.SGD(lr=0.1),
                              global_batch_size=4, max_steps=2, progress=False,
                              env=toolkit.LaunchEnv())
    history = trainer.fit(x, y)
    logp = want - np.log(np.exp(want - want.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - want.max(-1, keepdims=True)
    first = -np.take_along_axis(logp, y[..., None], -1).mean()
    assert history.losses[0] == pytest.approx(first, rel=1e-4)


def test_export_format_hf_from_a_checkpoint_round_trips(tmp_path):
    x = tokens(32, 16)
    trainer = toolkit.Trainer(adapters.get("horovod-torch"), SPEC, toolkit.Adam(lr=1e-2),
                              global_batch_size=8, max_steps=2, progress=False,
                              env=toolkit.LaunchEnv(), checkpoint_dir=tmp_path / "ckpt")
    trainer.fit(x, np.roll(x, -1, axis=1))
    export.main([str(tmp_path / "ckpt"), "--format", "hf", "--out", str(tmp_path / "hf")])
    spec = toolkit.GPT.from_pretrained(tmp_path / "hf")
    params = spec.init(seed=0)
    assert spec == toolkit.GPT(**{**SPEC.__dict__, "init_from": str(tmp_path / "hf")})
    saved = export.weights(toolkit.CheckpointStore(tmp_path / "ckpt").load("latest"))
    assert params.keys() == saved.keys()
    for name in saved:
        np.testing.assert_array_equal(params[name], saved[name], err_msg=name)


def test_export_format_hf_refuses_a_model_that_is_not_a_gpt(tmp_path):
    x = np.random.default_rng(0).normal(size=(16, 4)).astype(np.float32)
    toolkit.Trainer(adapters.get("horovod-torch"), toolkit.MLP((4, 3)), toolkit.SGD(lr=0.1),
                    global_batch_size=8, max_steps=1, progress=False, env=toolkit.LaunchEnv(),
                    checkpoint_dir=tmp_path / "ckpt").fit(x, np.zeros(16, np.int64))
    with pytest.raises(toolkit.ToolkitError, match="--format hf writes GPT-2 models"):
        export.main([str(tmp_path / "ckpt"), "--format", "hf", "--out", str(tmp_path / "hf")])


def test_a_directory_that_is_not_gpt2_is_refused(tmp_path):
    with pytest.raises(toolkit.ToolkitError, match="config.json does not exist"):
        toolkit.GPT.from_pretrained(tmp_path)
    save_pretrained(SPEC, SPEC.init(0), tmp_path / "d")
    (tmp_path / "d" / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(toolkit.ToolkitError, match="only GPT-2"):
        toolkit.GPT.from_pretrained(tmp_path / "d")
