"""Torch modules for the framework-neutral specs, and the layouts that map between the spec's
arrays and torch's own (``Linear.weight`` is (out, in), ``Conv2d.weight`` OIHW)."""

from __future__ import annotations

import numpy as np

from adapters.horovod_torch.models.gpt import build_gpt
from adapters.horovod_torch.models.layers import recomputing, same
from toolkit import GPT, MLP


def _T(a):
    return a.T


def _hwio_to_oihw(a):
    return a.transpose(3, 2, 0, 1)


def _oihw_to_hwio(a):
    return a.transpose(2, 3, 1, 0)


def to_host(t, from_torch) -> np.ndarray:
    # .numpy() shares the tensor's memory: always copy.
    return np.array(from_torch(t.detach().cpu().numpy()), order="C", copy=True)


def from_host(torch, a, to_torch, dtype, device):
    """A copy of the host array ``a`` in torch's layout, on ``device`` (never aliases the
    caller's array)."""
    return torch.tensor(np.asarray(to_torch(np.asarray(a))), dtype=dtype, device=device)


def saved_bytes(torch, forward) -> int:
    """The bytes autograd keeps for the backward pass while ``forward()`` runs (every tensor
    it saves, counted as it is packed): what activation checkpointing reduces."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return total


def build_spec_model(torch, spec, recompute: bool = False):
    """A torch module for a spec, and the (neutral name, parameter, to torch, from torch)
    layout that maps between the spec's arrays and torch's own layouts; ``recompute``: each
    GPT block or MLP layer recomputes its activations in the backward pass."""
    if isinstance(spec, GPT):
        return build_gpt(torch, spec, recompute=recompute)
    nn = torch.nn
    if isinstance(spec, MLP):
        act = torch.relu if spec.activation == "relu" else torch.tanh

        class Hidden(nn.Module):  # a hidden layer and its activation: the recomputed unit
            def __init__(self, layer):
                super().__init__()
                self.layer = layer

            def forward(self, x):
                return act(self.layer(x))

        class TorchMLP(nn.Module):
            def __init__(self):
                super().__init__()
                self.layers = nn.ModuleList(
                    nn.Linear(a, b) for a, b in zip(spec.sizes[:-1], spec.sizes[1:], strict=True))
                self.hidden = [recomputing(torch, Hidden(layer), recompute)
                               for layer in self.layers[:-1]]

            def forward(self, x):
                for unit in self.hidden:
                    x = unit(x)
                return self.layers[-1](x)

        net = TorchMLP()
        layout = []
        for i, layer in enumerate(net.layers):
            layout += [(f"layers.{i}.kernel", layer.weight, _T, _T),
                       (f"layers.{i}.bias", layer.bias, same, same)]
        return net, layout

    h, w, c = spec.image_shape
    widths = (c, *spec.channels)

    class TorchCNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.convs = nn.ModuleList(
                nn.Conv2d(a, b, spec.kernel_size, padding=spec.kernel_size // 2)
                for a, b in zip(widths[:-1], widths[1:], strict=True))
            self.head = nn.Linear(h * w * widths[-1], spec.classes)

        def forward(self, x):
            x = x.permute(0, 3, 1, 2)  # the spec's NHWC -> torch's NCHW
            for conv in self.convs:
                x = torch.relu(conv(x))
            return self.head(x.permute(0, 2, 3, 1).reshape(len(x), -1))  # flatten as (h, w, c)

    net = TorchCNN()
    layout = []
    for i, conv in enumerate(net.convs):
        layout += [(f"convs.{i}.kernel", conv.weight, _hwio_to_oihw, _oihw_to_hwio),
                   (f"convs.{i}.bias", conv.bias, same, same)]
    layout += [("head.kernel", net.head.weight, _T, _T), ("head.bias", net.head.bias, same, same)]
    return net, layout
