"""A decoder-only transformer (GPT-2's block) as a framework-neutral spec, with a numpy reference.

The contract every backend follows (torch, TF and Flax build the same function from the same
arrays):

- Parameters, by neutral name (kernels are ``(in, out)``: ``y = x @ kernel + bias``):
  ``tok_emb`` ``(vocab, width)``, ``pos_emb`` ``(context, width)``; per block ``i``
  ``blocks.{i}.ln1.scale|bias`` ``(width,)``, ``blocks.{i}.attn.qkv.kernel`` ``(width, 3*width)``
  (columns ``[q | k | v]``, head ``h`` of each part in columns ``h*dh:(h+1)*dh``, ``dh =
  width / heads``) and ``.bias`` ``(3*width,)``, ``blocks.{i}.attn.proj.kernel`` ``(width,
  width)`` (rows: the heads concatenated) and ``.bias``, ``blocks.{i}.ln2.scale|bias``,
  ``blocks.{i}.mlp.fc.kernel`` ``(width, 4*width)`` and ``.bias``, ``blocks.{i}.mlp.proj.kernel``
  ``(4*width, width)`` and ``.bias``; ``ln_f.scale|bias``; ``head.kernel`` ``(width, vocab)``
  only when ``tied=False`` (never a head bias).
- Forward, pre-LayerNorm, no dropout: ``h = tok_emb[x] + pos_emb[:T]``; per block
  ``h += proj(attn(LN1(h)))`` then ``h += proj(gelu(fc(LN2(h))))``; ``logits = LN_f(h) @
  tok_emb.T`` (tied) or ``@ head.kernel``. LayerNorm: biased variance over the last axis, eps
  1e-5. Attention: ``softmax(q @ k.T / sqrt(dh))`` with keys after the query masked out. GELU:
  the tanh form ``0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3)))``.
- Loss: token-level cross-entropy, the mean over every token of the batch.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os

import numpy as np

from toolkit.errors import ToolkitError
from toolkit.models import gpt2_files
from toolkit.models.choices import DTYPES, LOSSES, check_choice

LN_EPS = 1e-5
_GELU_C = math.sqrt(2.0 / math.pi)
_GELU_K = 0.044715


@dataclasses.dataclass(frozen=True)
class GPT:
    """A decoder-only transformer over token ids: ``(B, T)`` integers -> logits ``(B, T, vocab)``.

    Args:
        vocab: number of token ids (256 for bytes).
        context: the longest sequence, ``T <= context``.
        width: the residual stream's width; a multiple of ``heads``.
        layers: number of transformer blocks.
        heads: attention heads per block.
        tied: the output head reuses ``tok_emb`` (``logits = f @ tok_emb.T``).
        init_from: a GPT-2 directory whose weights ``init`` returns instead of drawing them
            (see :meth:`from_pretrained`).

    Example:
        >>> spec = GPT(vocab=256, context=16, width=32, layers=2, heads=2)
        >>> params = spec.init(seed=0, dtype="float64")
        >>> spec.apply(params, np.zeros((3, 5), np.int64)).shape
        (3, 5, 256)
    """

    vocab: int = 256
    context: int = 128
    width: int = 128
    layers: int = 4
    heads: int = 4
    tied: bool = True
    init_from: str | None = None

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike) -> GPT:
        """The GPT of a GPT-2 directory (``config.json`` + ``model.safetensors``, as
        ``GPT2LMHeadModel.save_pretrained`` or ``python -m adapters.export --format hf``
        write them): its ``init`` returns those weights, so any backend and layout fine-tunes
        them (tokens are the directory's vocabulary's ids)."""
        return cls(**gpt2_files.read_config(directory), init_from=str(directory))

    def __post_init__(self) -> None:
        for name in ("vocab", "context", "width", "layers", "heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ToolkitError(f"GPT {name}={value!r} must be a positive integer",
                                   "e.g. GPT(vocab=256, context=16, width=32, layers=2, heads=2)")
            object.__setattr__(self, name, int(value))
        if self.width % self.heads:
            raise ToolkitError(
                f"GPT width {self.width} is not divisible by heads {self.heads}",
                f"choose a width that is a multiple of the number of heads, e.g. "
                f"width={self.heads * max(1, round(self.width / self.heads))}")
        object.__setattr__(self, "tied", bool(self.tied))

    @property
    def activation(self) -> str:
        return "gelu_tanh"

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's neutral name and shape, in the contract's listing order."""
        w, shapes = self.width, {"tok_emb": (self.vocab, self.width),
                                 "pos_emb": (self.context, self.width)}
        for i in range(self.layers):
            p = f"blocks.{i}."
            shapes.update({
                p + "ln1.scale": (w,), p + "ln1.bias": (w,),
                p + "attn.qkv.kernel": (w, 3 * w), p + "attn.qkv.bias": (3 * w,),
                p + "attn.proj.kernel": (w, w), p + "attn.proj.bias": (w,),
                p + "ln2.scale": (w,), p + "ln2.bias": (w,),
                p + "mlp.fc.kernel": (w, 4 * w), p + "mlp.fc.bias": (4 * w,),
                p + "mlp.proj.kernel": (4 * w, w), p + "mlp.proj.bias": (w,)})
        shapes.update({"ln_f.scale": (w,), "ln_f.bias": (w,)})
        if not self.tied:
            shapes["head.kernel"] = (w, self.vocab)
        return shapes

    @property
    def num_params(self) -> int:
        return sum(math.prod(shape) for shape in self.param_shapes().values())

    def init(self, seed: int, dtype: str = "float32") -> dict[str, np.ndarray]:
        """GPT-2's initialisation, drawn in float64 in a fixed order, then cast to ``dtype``.

        With ``init_from``, the weights of that GPT-2 directory instead (``seed`` unused).
        Else Normal(0, 0.02) for ``tok_emb``, ``pos_emb``, ``qkv``, ``mlp.fc`` and ``head``;
        Normal(0, 0.02 / sqrt(2 * layers)) for the two residual projections (``attn.proj``,
        ``mlp.proj``); biases 0, LayerNorm scales 1. Draw order: ``tok_emb``, ``pos_emb``, per
        block ``qkv``, ``attn.proj``, ``mlp.fc``, ``mlp.proj``, then ``head`` if untied.
        """
        check_choice("dtype", dtype, DTYPES)
        if self.init_from is not None:  # a pretrained GPT-2's weights, whatever the seed
            spec = dataclasses.replace(GPT.from_pretrained(self.init_from),
                                       init_from=self.init_from)
            if spec != self:
                raise ToolkitError(f"{self.init_from} holds {spec}, not this {self}",
                                   f"build the spec with GPT.from_pretrained({self.init_from!r})")
            return gpt2_files.read_params(self.init_from, self.param_shapes(), dtype)
        rng = np.random.default_rng(seed)
        shapes = self.param_shapes()
        std, residual_std = 0.02, 0.02 / math.sqrt(2 * self.layers)
        drawn = {"tok_emb": rng.normal(0.0, std, shapes["tok_emb"]),
                 "pos_emb": rng.normal(0.0, std, shapes["pos_emb"])}
        for i in range(self.layers):
            for part, scale in (("attn.qkv", std), ("attn.proj", residual_std),
                                ("mlp.fc", std), ("mlp.proj", residual_std)):
                name = f"blocks.{i}.{part}.kernel"
                drawn[name] = rng.normal(0.0, scale, shapes[name])
        if not self.tied:
            drawn["head.kernel"] = rng.normal(0.0, std, shapes["head.kernel"])
        params = {}
        for name, shape in shapes.items():
            if name in drawn:
                params[name] = drawn[name].astype(dtype)
            else:
                params[name] = (np.ones if name.endswith(".scale") else np.zeros)(shape, dtype)
        return params

    def apply(self, params: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
        """Logits ``(B, T, vocab)`` for token ids ``x`` ``(B, T)``, in numpy (the reference)."""
        x = self._check_ids(x, "token id")
        return self._forward(params, x)[0].reshape(*x.shape, self.vocab)

    def loss_and_grads(self, params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray,
                       loss: str = "cross_entropy") -> tuple[float, dict[str, np.ndarray]]:
        """Mean token-level cross-entropy and its gradients, by hand in numpy (the reference).

        The mean is over every token of the batch (each sample has ``T`` tokens, so it is also
        the mean over samples of each sample's mean over its tokens).
        """
        check_choice("loss", loss, LOSSES)
        if loss != "cross_entropy":
            raise ToolkitError(f"loss {loss!r} does not apply to a GPT (its outputs are logits "
                               "over the vocabulary)", "use loss='cross_entropy'")
        x = self._check_ids(x, "token id")
        y = self._check_ids(y, "label")
        if y.shape != x.shape:
            raise ToolkitError(f"GPT labels have shape {y.shape} but the inputs {x.shape}",
                               "give one label (the next token) per input token")
        logits, cache = self._forward(params, x)
        n = logits.shape[0]
        rows, labels = np.arange(n), y.reshape(-1)
        shifted = logits - logits.max(1, keepdims=True)
        exp = np.exp(shifted)
        total = exp.sum(1, keepdims=True)
        value = float((np.log(total[:, 0]) - shifted[rows, labels]).mean())
        dlogits = exp / total
        dlogits[rows, labels] -= 1
        dlogits /= n
        return value, self._backward(params, x, dlogits, cache)

    def _check_ids(self, ids, what: str) -> np.ndarray:
        ids = np.asarray(ids)
        if ids.ndim != 2:
            raise ToolkitError(f"GPT {what}s need shape (batch, time), got shape {ids.shape}",
                               "pass token ids as a 2-D integer array, one row per sample")
        if not np.issubdtype(ids.dtype, np.integer):
            if not (np.issubdtype(ids.dtype, np.floating) and np.all(ids == np.round(ids))):
                raise ToolkitError(f"GPT {what}s must be integers, got dtype {ids.dtype}",
                                   "pass token ids as an integer array (e.g. np.int64)")
            ids = ids.astype(np.int64)
        if not 1 <= ids.shape[1] <= self.context:
            raise ToolkitError(
                f"sequence length {ids.shape[1]} does not fit the context of {self.context}",
                f"cut the text into windows of 1 to {self.context} tokens, or build the GPT "
                f"with a larger context")
        bad = (ids < 0) | (ids >= self.vocab)
        if bad.any():
            raise ToolkitError(f"{what} {ids[bad][0]} is outside the vocabulary of {self.vocab}",
                               f"ids must lie in [0, {self.vocab}); build GPT(vocab=...) large "
                               "enough for the tokenizer")
        return ids

    def _forward(self, params, x):
        """Logits as ``(B*T, vocab)`` and what the backward pass needs."""
        b, t = x.shape
        w, nh = self.width, self.heads
        dh = w // nh
        future = ~np.tril(np.ones((t, t), bool))  # key j > query i
        h = (params["tok_emb"][x] + params["pos_emb"][:t]).reshape(b * t, w)
        blocks = []
        for i in range(self.layers):
            p = f"blocks.{i}."
            a, ln1 = _layer_norm(h, params[p + "ln1.scale"], params[p + "ln1.bias"])
            qkv = a @ params[p + "attn.qkv.kernel"] + params[p + "attn.qkv.bias"]
            q, k, v = qkv.reshape(b, t, 3, nh, dh).transpose(2, 0, 3, 1, 4)  # each (B, H, T, dh)
            s = (q @ k.swapaxes(-1, -2)) / math.sqrt(dh)
            s[..., future] = -np.inf
            probs = np.exp(s - s.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            o = (probs @ v).transpose(0, 2, 1, 3).reshape(b * t, w)
            h = h + o @ params[p + "attn.proj.kernel"] + params[p + "attn.proj.bias"]
            m, ln2 = _layer_norm(h, params[p + "ln2.scale"], params[p + "ln2.bias"])
            z = m @ params[p + "mlp.fc.kernel"] + params[p + "mlp.fc.bias"]
            tanh = np.tanh(_GELU_C * (z + _GELU_K * z ** 3))
            g = 0.5 * z * (1.0 + tanh)
            h = h + g @ params[p + "mlp.proj.kernel"] + params[p + "mlp.proj.bias"]
            blocks.append((a, ln1, q, k, v, probs, o, m, ln2, z, tanh, g))
        f, ln_f = _layer_norm(h, params["ln_f.scale"], params["ln_f.bias"])
        head = params["tok_emb"].T if self.tied else params["head.kernel"]
        return f @ head, (blocks, f, ln_f)

    def _backward(self, params, x, dlogits, cache):
        blocks, f, ln_f = cache
        b, t = x.shape
        w, nh = self.width, self.heads
        dh = w // nh
        grads = {}
        if self.tied:
            tok_grad = dlogits.T @ f
            df = dlogits @ params["tok_emb"]
        else:
            tok_grad = np.zeros_like(params["tok_emb"])
            grads["head.kernel"] = f.T @ dlogits
            df = dlogits @ params["head.kernel"].T
        dres, grads["ln_f.scale"], grads["ln_f.bias"] = _layer_norm_grad(
            df, params["ln_f.scale"], ln_f)
        for i in reversed(range(self.layers)):
            p = f"blocks.{i}."
            a, ln1, q, k, v, probs, o, m, ln2, z, tanh, g = blocks[i]
            # MLP: h += gelu(m @ fc + b) @ proj + b
            grads[p + "mlp.proj.kernel"] = g.T @ dres
            grads[p + "mlp.proj.bias"] = dres.sum(0)
            dg = dres @ params[p + "mlp.proj.kernel"].T
            dgelu = 0.5 * (1.0 + tanh) + 0.5 * z * (1.0 - tanh ** 2) * _GELU_C * (
                1.0 + 3.0 * _GELU_K * z ** 2)
            dz = dg * dgelu
            grads[p + "mlp.fc.kernel"] = m.T @ dz
            grads[p + "mlp.fc.bias"] = dz.sum(0)
            dm, grads[p + "ln2.scale"], grads[p + "ln2.bias"] = _layer_norm_grad(
                dz @ params[p + "mlp.fc.kernel"].T, params[p + "ln2.scale"], ln2)
            dres = dres + dm
            # attention: h += concat_heads(softmax(q k^T / sqrt(dh)) v) @ proj + b
            grads[p + "attn.proj.kernel"] = o.T @ dres
            grads[p + "attn.proj.bias"] = dres.sum(0)
            do = (dres @ params[p + "attn.proj.kernel"].T).reshape(b, t, nh, dh)
            do = do.transpose(0, 2, 1, 3)
            dv = probs.swapaxes(-1, -2) @ do
            dprobs = do @ v.swapaxes(-1, -2)
            # softmax backward; masked entries have probs 0, so their ds is 0 too
            ds = probs * (dprobs - (dprobs * probs).sum(-1, keepdims=True)) / math.sqrt(dh)
            dq = ds @ k
            dk = ds.swapaxes(-1, -2) @ q
            dqkv = np.stack((dq, dk, dv)).transpose(1, 3, 0, 2, 4).reshape(b * t, 3 * w)
            grads[p + "attn.qkv.kernel"] = a.T @ dqkv
            grads[p + "attn.qkv.bias"] = dqkv.sum(0)
            da, grads[p + "ln1.scale"], grads[p + "ln1.bias"] = _layer_norm_grad(
                dqkv @ params[p + "attn.qkv.kernel"].T, params[p + "ln1.scale"], ln1)
            dres = dres + da
        # the embeddings: h = tok_emb[x] + pos_emb[:T]
        np.add.at(tok_grad, x.reshape(-1), dres)
        grads["tok_emb"] = tok_grad
        grads["pos_emb"] = np.zeros_like(params["pos_emb"])
        grads["pos_emb"][:t] = dres.reshape(b, t, w).sum(0)
        return {name: grads[name] for name in params}


def _layer_norm(z, scale, bias):
    """LayerNorm over the last axis (biased variance, eps 1e-5), and ``(normed, rstd)``."""
    centred = z - z.mean(-1, keepdims=True)
    rstd = 1.0 / np.sqrt((centred ** 2).mean(-1, keepdims=True) + LN_EPS)
    normed = centred * rstd
    return normed * scale + bias, (normed, rstd)


def _layer_norm_grad(dout, scale, cache):
    """Gradients of LayerNorm w.r.t. its input, its scale and its bias."""
    normed, rstd = cache
    dnormed = dout * scale
    dz = rstd * (dnormed - dnormed.mean(-1, keepdims=True)
                 - normed * (dnormed * normed).mean(-1, keepdims=True))
    return dz, (dout * normed).sum(0), dout.sum(0)
