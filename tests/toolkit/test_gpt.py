"""toolkit.GPT: the contract's initialisation, an independent forward, hand-written gradients
against finite differences, and the errors a user sees."""

import json
import math

import numpy as np
import pytest

from toolkit import GPT, SGD, Adam, ToolkitError
from toolkit.checkpoint.resume import describe as _describe
from toolkit.models.reference import reference_run
from toolkit.models.specs import ModelSpec, spec_from_dict

SMALL = {"vocab": 11, "context": 7, "width": 8, "layers": 2, "heads": 2}


def _random_params(spec: GPT, seed: int) -> dict[str, np.ndarray]:
    """Parameters far from the init (non-trivial LN scales, biases, attention patterns), so that
    every term of the backward pass carries a sizeable gradient."""
    rng = np.random.default_rng(seed)
    params = spec.init(seed, "float64")
    for name, p in params.items():
        base = 1.0 if name.endswith(".scale") else 0.0
        params[name] = base + rng.normal(0.0, 0.4, p.shape)
    return params


# ---------------------------------------------------------------------------------------------
# forward: an obvious per-position loop, written from the contract, independent of the module


def _slow_logits(spec: GPT, params: dict[str, np.ndarray], tokens: np.ndarray) -> np.ndarray:
    """Logits of one sequence, computed position by position from its prefix only."""

    def layer_norm(v, name):
        mean = sum(v) / len(v)
        var = sum((e - mean) ** 2 for e in v) / len(v)
        return (v - mean) / math.sqrt(var + 1e-5) * params[f"{name}.scale"] + params[f"{name}.bias"]

    def gelu(z):
        return np.array([0.5 * e * (1 + math.tanh(math.sqrt(2 / math.pi) * (e + 0.044715 * e ** 3)))
                         for e in z])

    dh = spec.width // spec.heads
    out = []
    for pos in range(len(tokens)):
        # the residual stream of every position up to and including pos
        hs = [params["tok_emb"][tokens[j]] + params["pos_emb"][j] for j in range(pos + 1)]
        for i in range(spec.layers):
            blk = f"blocks.{i}"
            qkv = [layer_norm(h, f"{blk}.ln1") @ params[f"{blk}.attn.qkv.kernel"]
                   + params[f"{blk}.attn.qkv.bias"] for h in hs]
            new = []
            for qpos in range(len(hs)):
                heads_out = []
                for head in range(spec.heads):
                    q = qkv[qpos][head * dh:(head + 1) * dh]
                    keys = [qkv[j][spec.width + head * dh:spec.width + (head + 1) * dh]
                            for j in range(qpos + 1)]
                    vals = [qkv[j][2 * spec.width + head * dh:2 * spec.width + (head + 1) * dh]
                            for j in range(qpos + 1)]
                    scores = [float(q @ key) / math.sqrt(dh) for key in keys]
                    top = max(scores)
                    weights = [math.exp(s - top) for s in scores]
                    heads_out.append(sum(wt * v for wt, v in zip(weights, vals, strict=True))
                                     / sum(weights))
                o = np.concatenate(heads_out)
                h = (hs[qpos] + o @ params[f"{blk}.attn.proj.kernel"]
                     + params[f"{blk}.attn.proj.bias"])
                m = layer_norm(h, f"{blk}.ln2")
                z = m @ params[f"{blk}.mlp.fc.kernel"] + params[f"{blk}.mlp.fc.bias"]
                new.append(h + gelu(z) @ params[f"{blk}.mlp.proj.kernel"]
                           + params[f"{blk}.mlp.proj.bias"])
            hs = new
        f = layer_norm(hs[pos], "ln_f")
        head = params["tok_emb"].T if spec.tied else params["head.kernel"]
        out.append(f @ head)
    return np.array(out)


@pytest.mark.parametrize("tied", [True, False])
def test_forward_equals_a_per_position_loop(tied):
    spec = GPT(**SMALL, tied=tied)
    params = _random_params(spec, 3)
    x = np.random.default_rng(4).integers(0, spec.vocab, (2, 5))
    logits = spec.apply(params, x)
    assert logits.shape == (2, 5, spec.vocab)
    for b in range(2):
        np.testing.assert_allclose(logits[b], _slow_logits(spec, params, x[b]), rtol=1e-10,
                                   atol=1e-10)


def test_forward_is_causal():
    spec = GPT(**SMALL)
    params = _random_params(spec, 5)
    x = np.random.default_rng(6).integers(0, spec.vocab, (3, 6))
    before = spec.apply(params, x)
    changed = x.copy()
    changed[:, 4] = (changed[:, 4] + 1) % spec.vocab
    after = spec.apply(params, changed)
    np.testing.assert_array_equal(after[:, :4], before[:, :4])
    assert np.abs(after[:, 4:] - before[:, 4:]).min() > 0  # the later ones did change
    # a shorter sequence gives the same logits as the prefix of a longer one
    np.testing.assert_allclose(spec.apply(params, x[:, :3]), before[:, :3], rtol=1e-12,
                               atol=1e-12)


# ---------------------------------------------------------------------------------------------
# gradients


def _loss_by_hand(spec, params, x, y):
    logits = spec.apply(params, x).reshape(-1, spec.vocab)
    top = logits.max(1, keepdims=True)
    log_probs = logits - top - np.log(np.exp(logits - top).sum(1, keepdims=True))
    return -log_probs[np.arange(len(logits)), y.reshape(-1)].mean()


def _central_difference(loss, flat, i, eps=1e-3):
    """d loss / d flat[i] by the fourth-order central difference (error O(eps^4)): with the
    plain two-point one, float64 round-off (~1e-16 / eps) alone is ~1e-6 of a small gradient."""
    old, values = flat[i], []
    for step in (2, 1, -1, -2):
        flat[i] = old + step * eps
        values.append(loss())
    flat[i] = old
    up2, up1, down1, down2 = values
    return (-up2 + 8 * up1 - 8 * down1 + down2) / (12 * eps)


@pytest.mark.parametrize("tied", [True, False])
def test_gradients_match_central_differences(tied):
    spec = GPT(**SMALL, tied=tied)
    params = _random_params(spec, 1)
    rng = np.random.default_rng(2)
    t = spec.context - 2  # T < context: pos_emb rows past T get no gradient
    x = rng.integers(0, spec.vocab, (3, t))
    y = rng.integers(0, spec.vocab, (3, t))
    value, grads = spec.loss_and_grads(params, x, y)
    assert value == pytest.approx(_loss_by_hand(spec, params, x, y), rel=1e-12)
    assert set(grads) == set(params)
    assert ("head.kernel" in params) == (not tied)
    np.testing.assert_array_equal(grads["pos_emb"][t:], 0)
    used = np.unique(x)
    for name, p in params.items():
        assert grads[name].shape == p.shape and grads[name].dtype == p.dtype, name
        flat = p.reshape(-1)
        if name == "tok_emb":  # rows of tokens in x (and, when tied, any row via the head)
            rows = rng.choice(used, 4)
            picks = rows * spec.width + rng.integers(0, spec.width, 4)
            picks = np.append(picks, rng.integers(0, flat.size, 2))
        elif name == "pos_emb":
            picks = rng.integers(0, t * spec.width, 6)
        else:
            picks = rng.choice(flat.size, min(6, flat.size), replace=False)
        for i in picks:
            numeric = _central_difference(lambda: spec.loss_and_grads(params, x, y)[0], flat, i)
            analytic = grads[name].reshape(-1)[i]
            scale = max(abs(numeric), abs(analytic))
            assert scale < 1e-9 or abs(analytic - numeric) / scale < 1e-6, (
                name, i, analytic, numeric)


def test_untied_token_rows_not_in_the_batch_get_no_gradient():
    spec = GPT(**SMALL, tied=False)
    params = _random_params(spec, 7)
    x = np.array([[1, 2, 3], [3, 2, 1]])
    grads = spec.loss_and_grads(params, x, x)[1]
    unused = np.setdiff1d(np.arange(spec.vocab), x)
    np.testing.assert_array_equal(grads["tok_emb"][unused], 0)
    assert np.abs(grads["tok_emb"][[1, 2, 3]]).min() > 0


def test_float32_gradients_are_float32_and_close_to_float64():
    spec = GPT(**SMALL)
    p64 = _random_params(spec, 8)
    p32 = {k: v.astype(np.float32) for k, v in p64.items()}
    x = np.random.default_rng(9).integers(0, spec.vocab, (2, 4))
    v64, g64 = spec.loss_and_grads(p64, x, x)
    v32, g32 = spec.loss_and_grads(p32, x, x)
    assert v32 == pytest.approx(v64, rel=1e-5)
    for name in p64:
        assert g32[name].dtype == np.float32, name
        np.testing.assert_allclose(g32[name], g64[name], rtol=1e-3, atol=1e-5, err_msg=name)


# ---------------------------------------------------------------------------------------------
# initialisation


def test_init_follows_the_contracts_draw_order():
    spec = GPT(vocab=13, context=5, width=6, layers=3, heads=3, tied=False)
    params = spec.init(42, "float64")
    rng = np.random.default_rng(42)
    expected = {"tok_emb": rng.normal(0, 0.02, (13, 6)), "pos_emb": rng.normal(0, 0.02, (5, 6))}
    small = 0.02 / math.sqrt(2 * 3)
    for i in range(3):
        expected[f"blocks.{i}.attn.qkv.kernel"] = rng.normal(0, 0.02, (6, 18))
        expected[f"blocks.{i}.attn.proj.kernel"] = rng.normal(0, small, (6, 6))
        expected[f"blocks.{i}.mlp.fc.kernel"] = rng.normal(0, 0.02, (6, 24))
        expected[f"blocks.{i}.mlp.proj.kernel"] = rng.normal(0, small, (24, 6))
    expected["head.kernel"] = rng.normal(0, 0.02, (6, 13))
    for name, array in expected.items():
        np.testing.assert_array_equal(params[name], array, err_msg=name)
    names = ["tok_emb", "pos_emb"]
    for i in range(3):
        names += [f"blocks.{i}.{n}" for n in (
            "ln1.scale", "ln1.bias", "attn.qkv.kernel", "attn.qkv.bias", "attn.proj.kernel",
            "attn.proj.bias", "ln2.scale", "ln2.bias", "mlp.fc.kernel", "mlp.fc.bias",
            "mlp.proj.kernel", "mlp.proj.bias")]
    assert sorted(params) == sorted(names + ["ln_f.scale", "ln_f.bias", "head.kernel"])
    for name in set(params) - set(expected):
        want = 1.0 if name.endswith(".scale") else 0.0
        assert params[name].shape == (3 * 6 if "qkv" in name else 24 if "fc" in name else 6,)
        np.testing.assert_array_equal(params[name], want, err_msg=name)
    assert spec.num_params == sum(p.size for p in params.values())


def test_init_statistics_seed_and_dtype():
    spec = GPT()  # the defaults: 256 x 128, 4 layers
    params = spec.init(0)
    assert all(p.dtype == np.float32 for p in params.values())
    assert "head.kernel" not in params
    for name, std in [("tok_emb", 0.02), ("pos_emb", 0.02), ("blocks.2.attn.qkv.kernel", 0.02),
                      ("blocks.2.mlp.fc.kernel", 0.02),
                      ("blocks.2.attn.proj.kernel", 0.02 / math.sqrt(8)),
                      ("blocks.2.mlp.proj.kernel", 0.02 / math.sqrt(8))]:
        assert params[name].std() == pytest.approx(std, rel=0.05), name
        assert abs(params[name].mean()) < 0.1 * std, name
    again, other = spec.init(0), spec.init(1)
    assert all(np.array_equal(params[k], again[k]) for k in params)
    assert not np.array_equal(params["tok_emb"], other["tok_emb"])
    p64 = spec.init(0, "float64")
    assert all(p64[k].dtype == np.float64 and np.array_equal(p64[k].astype(np.float32), params[k])
               for k in params)
    # tied and untied draw the shared arrays identically (the head is drawn last)
    untied = GPT(tied=False).init(0, "float64")
    assert all(np.array_equal(p64[k], untied[k]) for k in p64)
    with pytest.raises(ToolkitError, match="float16"):
        spec.init(0, "float16")


def test_initial_loss_is_near_uniform():
    spec = GPT(vocab=256, context=16, width=32, layers=2, heads=2)
    x = np.random.default_rng(0).integers(0, 256, (16, 16))
    value, _ = spec.loss_and_grads(spec.init(0, "float64"), x, np.roll(x, -1, 1))
    assert value == pytest.approx(math.log(256), abs=0.05)  # std-0.02 weights: logits near 0


# ---------------------------------------------------------------------------------------------
# errors, registration, the reference run


@pytest.mark.parametrize("kwargs, needles", [
    ({"width": 30, "heads": 4}, ["30", "4", "divisible"]),
    ({"layers": 0}, ["layers=0"]),
    ({"vocab": -3}, ["vocab=-3"]),
    ({"context": 2.5}, ["context=2.5"]),
])
def test_bad_specs(kwargs, needles):
    with pytest.raises(ToolkitError) as err:
        GPT(**kwargs)
    assert all(n in str(err.value) for n in needles) and "HINT" in str(err.value)


def test_bad_inputs_name_the_value():
    spec = GPT(vocab=256, context=16, width=32, layers=2, heads=2)
    params = spec.init(0, "float64")
    ok = np.zeros((2, 8), np.int64)
    cases = [
        (lambda: spec.apply(params, np.full((2, 8), 300)), "token id 300 is outside the "
                                                            "vocabulary of 256"),
        (lambda: spec.apply(params, np.full((2, 8), -1)), "token id -1"),
        (lambda: spec.apply(params, np.zeros((2, 17), np.int64)), "sequence length 17"),
        (lambda: spec.apply(params, np.zeros(8, np.int64)), "shape (8,)"),
        (lambda: spec.apply(params, np.full((2, 8), 0.5)), "float64"),
        (lambda: spec.loss_and_grads(params, ok, np.full((2, 8), 256)), "label 256"),
        (lambda: spec.loss_and_grads(params, ok, ok[:, :4]), "(2, 4)"),
        (lambda: spec.loss_and_grads(params, ok, ok, "mse"), "'mse'"),
        (lambda: spec.loss_and_grads(params, ok, ok, "hinge"), "'hinge'"),
    ]
    for call, needle in cases:
        with pytest.raises(ToolkitError) as err:
            call()
        assert needle in str(err.value) and "HINT" in str(err.value), str(err.value)
    # whole-number floats are token ids too
    np.testing.assert_array_equal(spec.apply(params, ok.astype(np.float32)), spec.apply(params, ok))


def test_spec_round_trips_through_the_manifest():
    for spec in (GPT(), GPT(vocab=50, context=9, width=12, layers=1, heads=3, tied=False)):
        described = json.loads(json.dumps(_describe(spec)))
        assert described["type"] == "GPT"
        assert spec_from_dict(described) == spec
        assert isinstance(spec, ModelSpec)


def test_reference_run_trains_a_gpt():
    spec = GPT(vocab=256, context=16, width=32, layers=2, heads=2)
    tokens = np.frombuffer(b"the quick brown fox jumps over the lazy dog. " * 20, np.uint8)
    tokens = tokens.astype(np.int64)
    windows = (len(tokens) - 1) // 16
    x = tokens[:windows * 16].reshape(windows, 16)
    y = tokens[1:windows * 16 + 1].reshape(windows, 16)
    losses, params = reference_run(spec, Adam(lr=3e-3), "cross_entropy", x, y,
                                   global_batch_size=16, steps=30, seed=0)
    assert len(losses) == 30 and all(np.isfinite(losses))
    assert losses[0] == pytest.approx(math.log(256), abs=0.05)
    assert losses[-1] < losses[0] - 1.0  # a repeated sentence is easy to learn
    assert set(params) == set(spec.init(0)) and params["tok_emb"].dtype == np.float64
    # one SGD step is params - lr * grads of the first batch
    from toolkit.data.sampler import GlobalBatchSampler

    first = next(iter(GlobalBatchSampler(len(x), 16, seed=0)))
    _, grads = spec.loss_and_grads(spec.init(0, "float64"), x[first], y[first])
    _, stepped = reference_run(spec, SGD(lr=0.1), "cross_entropy", x, y, global_batch_size=16,
                               steps=1, seed=0)
    init = spec.init(0, "float64")
    for name in init:
        np.testing.assert_allclose(stepped[name], init[name] - 0.1 * grads[name], rtol=1e-12,
                                   atol=1e-15)
