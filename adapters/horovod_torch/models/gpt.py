"""The decoder-only transformer of ``toolkit.GPT`` as a torch module (see the contract in
``toolkit/models/gpt.py``: pre-LayerNorm blocks, tanh GELU, causal attention, optional tied head).

Layout choice: every weight is a plain ``nn.Parameter`` in the neutral layout, kernels (in, out)
used as ``x @ kernel + bias`` (through ``torch.addmm``, one BLAS call for the matmul and the bias),
and the submodules are named so that ``named_parameters()`` yields exactly the neutral names
(``blocks.0.attn.qkv.kernel``, ...). The layout's conversions are therefore all the identity: no
transpose on import/export, and the optimizer state needs no reshuffling either. (On CPU, a GEMM
with an (in, out) right operand is as fast as ``nn.Linear``'s transposed (out, in) weight.)

The tied head is ``F.linear(f, tok_emb)``, i.e. ``f @ tok_emb.T`` with the same Parameter as the
embedding lookup, so autograd sums both uses into one gradient. There is no ``head.kernel`` then.

Attention is ``F.scaled_dot_product_attention(..., is_causal=True)``: it matches the explicit
masked softmax to float64 rounding (``tests/adapters/test_gpt_models.py`` checks both) and is
faster on CPU; ``build_gpt(..., sdpa=False)`` gives the explicit form.
"""

from __future__ import annotations

import math

from adapters.horovod_torch.models.layers import recomputing, same


def build_gpt(torch, spec, *, sdpa: bool = True, recompute: bool = False):
    """A torch module for the ``toolkit.GPT`` spec, and its layout.

    Returns ``(net, layout)``: ``net(x)`` maps token ids ``(B, T)`` (``T <= spec.context``) to
    logits ``(B, T, vocab)``; ``layout`` is a list of ``(neutral_name, parameter, to_torch,
    from_torch)`` in the contract's order, as ``models/spec.build_spec_model``'s (here every
    conversion is the identity). Parameters are created uninitialised in torch's default dtype:
    move the net to its dtype and copy ``spec.init(seed, dtype)`` in through the layout.
    """
    nn, F = torch.nn, torch.nn.functional
    width, heads = spec.width, spec.heads
    dh = width // heads

    def param(*shape):
        return nn.Parameter(torch.empty(*shape))

    class Dense(nn.Module):
        def __init__(self, fan_in, fan_out):
            super().__init__()
            self.kernel, self.bias = param(fan_in, fan_out), param(fan_out)

        def forward(self, x):
            flat = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.kernel)
            return flat.view(*x.shape[:-1], -1)

    class LayerNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale, self.bias = param(width), param(width)

        def forward(self, x):  # biased variance over the last axis, eps 1e-5: the contract's
            acc = torch.promote_types(x.dtype, torch.float32)  # (never in bfloat16)
            with torch.autocast(x.device.type, enabled=False):
                return F.layer_norm(x.to(acc), (width,), self.scale.to(acc),
                                    self.bias.to(acc), eps=1e-5).to(x.dtype)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.proj = Dense(width, 3 * width), Dense(width, width)

        def forward(self, a):
            B, T, _ = a.shape
            # columns [q | k | v], head h at h*dh:(h+1)*dh of each -> 3 x (B, H, T, dh)
            q, k, v = self.qkv(a).view(B, T, 3, heads, dh).permute(2, 0, 3, 1, 4).unbind(0)
            if sdpa:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                s = (q @ k.transpose(-2, -1)) / math.sqrt(dh)
                mask = torch.ones(T, T, dtype=torch.bool, device=a.device).triu(1)
                s = s.to(torch.promote_types(s.dtype, torch.float32))  # (the weights in
                o = torch.softmax(s.masked_fill(mask, float("-inf")), dim=-1).to(v.dtype) @ v
            return self.proj(o.transpose(1, 2).reshape(B, T, width))  # heads concatenated

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.proj = Dense(width, 4 * width), Dense(4 * width, width)

        def forward(self, m):
            return self.proj(F.gelu(self.fc(m), approximate="tanh"))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.attn, self.ln2, self.mlp = LayerNorm(), Attention(), LayerNorm(), MLP()

        def forward(self, h):
            h = h + self.attn(self.ln1(h))
            return h + self.mlp(self.ln2(h))

    class TorchGPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_emb = param(spec.vocab, width)
            self.pos_emb = param(spec.context, width)
            self.blocks = nn.ModuleList(Block() for _ in range(spec.layers))
            self.ln_f = LayerNorm()
            self.head = None
            if not spec.tied:  # a kernel only: the contract's head has no bias
                self.head = nn.Module()
                self.head.kernel = param(width, spec.vocab)

        def forward(self, x):
            T = x.shape[1]
            h = F.embedding(x, self.tok_emb) + self.pos_emb[:T]
            for block in self.blocks:  # (recompute: each block's activations recomputed)
                h = recomputing(torch, block, recompute)(h)
            f = self.ln_f(h)
            if self.head is None:
                return F.linear(f, self.tok_emb)  # f @ tok_emb.T, the same Parameter
            return f @ self.head.kernel

    net = TorchGPT()
    layout = [(name, p, same, same) for name, p in net.named_parameters()]
    return net, layout
