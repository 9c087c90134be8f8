"""The GPT spec built in torch, TF and Flax (adapters/_gpt_*.py) is the numpy reference's
function: the same logits, mean token cross-entropy and gradients, from the same arrays.

float64: to rounding (logits 1e-12, gradients 1e-10, relative to each array's largest entry).
float32: against the float64 reference, with a loose bound that only catches a wrong model;
the deviations are printed (``pytest -s``)."""

import numpy as np
import pytest

from toolkit import GPT

FRAMEWORKS = ("torch", "tf", "flax")
LOOSE = {"logits": 1e-4, "loss": 1e-5, "grads": 1e-3}  # float32 vs the float64 reference


def tiny(tied: bool) -> GPT:
    return GPT(vocab=32, context=8, width=16, layers=2, heads=2, tied=tied)


def batch(spec: GPT, t: int):
    rng = np.random.default_rng(7)
    return rng.integers(0, spec.vocab, (3, t)), rng.integers(0, spec.vocab, (3, t))


def rel(got, want) -> float:
    """Largest deviation relative to the reference's largest magnitude."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-300))


# Each runner: (spec, neutral params, x, y, dtype) -> (logits, mean token CE, neutral grads).
def run_torch(spec, params, x, y, dtype, sdpa=True):
    import torch

    from adapters.horovod_torch.models.gpt import build_gpt

    net, layout = build_gpt(torch, spec, sdpa=sdpa)
    net.to(getattr(torch, dtype))
    assert {name: tuple(p.shape) for name, p, *_ in layout} == \
        {name: a.shape for name, a in params.items()}  # neutral names; identity conversions
    with torch.no_grad():
        for name, p, to_torch, _ in layout:
            p.copy_(torch.from_numpy(np.ascontiguousarray(to_torch(params[name]))))
    logits = net(torch.from_numpy(x))
    tokens = torch.nn.functional.cross_entropy(
        logits.reshape(-1, spec.vocab), torch.from_numpy(y).reshape(-1), reduction="none")
    loss = tokens.reshape(len(x), -1).mean(dim=1).mean()  # per-sample means, then the batch's
    loss.backward()
    grads = {name: from_torch(p.grad.numpy()) for name, p, _, from_torch in layout}
    return logits.detach().numpy(), loss.item(), grads


def run_tf(spec, params, x, y, dtype):
    import tensorflow as tf

    from adapters.horovod_tf.models.gpt import gpt_forward

    variables = {n: tf.Variable(v, name=n.replace(".", "_")) for n, v in params.items()}

    # Dynamic (B, T): one trace serves every sequence length.
    @tf.function(input_signature=[tf.TensorSpec([None, None], tf.int64)] * 2)
    def step(x, y):
        with tf.GradientTape() as tape:
            logits = gpt_forward(tf, spec, variables, x)
            tokens = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
            loss = tf.reduce_mean(tf.reduce_mean(tokens, axis=1))
        return logits, loss, tape.gradient(loss, variables)

    logits, loss, grads = step(tf.constant(x, tf.int64), tf.constant(y, tf.int64))
    assert all(isinstance(g, tf.Tensor) for g in grads.values())  # dense, no IndexedSlices
    return logits.numpy(), float(loss), {n: g.numpy() for n, g in grads.items()}


def run_flax(spec, params, x, y, dtype):
    import jax

    if dtype == "float64":  # before any array is made; the JAX adapters do the same
        jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp

    from adapters._jax.models.gpt import FlaxGPT, from_tree, to_tree

    module = FlaxGPT(spec)

    def loss_fn(tree, x, y):
        logits = module.apply({"params": tree}, x)
        logp = jax.nn.log_softmax(logits, axis=-1)
        tokens = -jnp.take_along_axis(logp, y[..., None], axis=-1)[..., 0]
        return jnp.mean(jnp.mean(tokens, axis=1)), logits

    tree = jax.tree_util.tree_map(jnp.asarray, to_tree(params))
    (loss, logits), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(
        tree, jnp.asarray(x), jnp.asarray(y))
    assert logits.dtype == jnp.dtype(dtype)
    return np.asarray(logits), float(loss), {n: np.asarray(g) for n, g in from_tree(grads).items()}


RUNNERS = {"torch": run_torch, "tf": run_tf, "flax": run_flax}


def compare(framework, spec, dtype, t):
    """Deviations of the framework from the float64 reference on a (3, t) batch."""
    x, y = batch(spec, t)
    ref_params = spec.init(0, "float64")
    want_loss, want_grads = spec.loss_and_grads(ref_params, x, y)
    logits, loss, grads = RUNNERS[framework](spec, spec.init(0, dtype), x, y, dtype)
    assert set(grads) == set(want_grads) == set(ref_params)
    return {"logits": rel(logits, spec.apply(ref_params, x)),
            "loss": abs(loss - float(want_loss)) / abs(float(want_loss)),
            "grads": max(rel(grads[n], want_grads[n]) for n in want_grads)}


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_float64_matches_the_reference(framework, tied):
    spec = tiny(tied)
    for t in (spec.context, 5):  # the full context and a shorter sequence
        dev = compare(framework, spec, "float64", t)
        assert dev["logits"] < 1e-12, dev
        assert dev["loss"] < 1e-12, dev
        assert dev["grads"] < 1e-10, dev


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_float32_is_close_to_the_reference(framework, tied):
    dev = compare(framework, tiny(tied), "float32", 8)
    print(f"\nfloat32 {framework} tied={tied}: " + ", ".join(
        f"{k} {v:.2e}" for k, v in dev.items()))
    for key, bound in LOOSE.items():
        assert dev[key] < bound, dev


def test_torch_attention_without_sdpa_is_the_same_function():
    spec = tiny(True)
    x, y = batch(spec, 8)
    params = spec.init(0, "float64")
    a = run_torch(spec, params, x, y, "float64", sdpa=True)
    b = run_torch(spec, params, x, y, "float64", sdpa=False)
    assert rel(a[0], b[0]) < 1e-13
    assert max(rel(a[2][n], b[2][n]) for n in params) < 1e-11


def test_torch_tied_head_shares_the_embedding_parameter():
    import torch

    from adapters.horovod_torch.models.gpt import build_gpt

    net, layout = build_gpt(torch, tiny(True))
    assert "head.kernel" not in dict((n, p) for n, p, *_ in layout)
    _, untied = build_gpt(torch, tiny(False))
    assert [n for n, *_ in untied][-1] == "head.kernel"


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_flax_tree_round_trip_and_layout(tied):
    import jax

    from adapters._jax.models.gpt import FlaxGPT, from_tree, name_of, path_of, to_tree

    spec = tiny(tied)
    params = spec.init(0, "float32")
    tree = to_tree(params)
    back = from_tree(tree)
    assert set(back) == set(params) and all(back[n] is params[n] for n in params)
    assert all(name_of(path_of(n)) == n for n in params)
    assert path_of("blocks.1.attn.qkv.kernel") == ("blocks_1", "attn", "qkv", "kernel")
    assert path_of("tok_emb") == ("tok_emb",) and path_of("ln_f.scale") == ("ln_f", "scale")
    # The module's own parameter tree has exactly this structure and these shapes.
    x, _ = batch(spec, 8)
    own = FlaxGPT(spec).init(jax.random.key(0), x)["params"]
    shapes = jax.tree_util.tree_map(np.shape, own)
    assert shapes == jax.tree_util.tree_map(np.shape, tree)
