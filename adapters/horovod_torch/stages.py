"""A model cut into pipeline pieces for the ``horovod-torch`` backend (``_torch_pipeline.py``).

Spec models (``toolkit.MLP``, ``CNN``, ``GPT``) are cut by ``toolkit.partition_model``: the full
torch module is built once (parameters uninitialised), each piece keeps references to the
submodules of its layers only (a GPT's embeddings on the first piece, ``ln_f`` and the head on
the last), and the module itself is dropped, so a rank holds only its stage's parameters. A tied
GPT head needs ``tok_emb`` on the last piece too: that piece holds its own copy (a separate
Parameter when it lives on another rank), whose gradient the executor adds to the first piece's
before both apply the same update (Megatron-LM's embedding group). A native ``nn.Sequential`` is
cut by index (balanced by parameter count, or at the layout's split points); any other native
module cannot be cut soundly and is refused. A parameter that two of its layers share keeps one
name on every stage that holds it, so that the executor keeps the copies equal.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from toolkit import ToolkitError
from toolkit.models.specs import ModelSpec
from toolkit.parallel.pipeline.partition import partition_layers, partition_model

SEQUENTIAL_ONLY = ("a pipeline cuts a model into consecutive pieces: pass a toolkit.MLP/CNN/GPT "
                   "spec, or a torch.nn.Sequential (cut by index)")


@dataclasses.dataclass
class Piece:
    """One of the ``S x v`` pieces (virtual stages) of a model.

    Attributes:
        index: the virtual stage ``k`` (stage ``k % S``, local chunk ``k // S``).
        forward: maps the piece's input (the model's input on piece 0, else the previous
            piece's output) to its output (the model's output on the last piece).
        params: ``(neutral name, parameter, to_torch, from_torch)`` of the piece's parameters.
        modules: the torch modules the piece runs (for ``train()``/``eval()`` and buffers).
    """

    index: int
    forward: Callable[[Any], Any]
    params: list[tuple[str, Any, Callable, Callable]]
    modules: list[Any]


@dataclasses.dataclass
class CutModel:
    """The pieces one stage holds, and the full model's catalogue of names.

    Attributes:
        pieces: this stage's pieces by local chunk.
        names_by_stage: every stage's parameter names (a tied parameter on two stages).
        shapes: every parameter's neutral shape, in the model's order.
        buffers: this stage's buffers, ``(name, tensor)``; ``buffer_specs``: every stage's
            buffers as ``name -> (stage, shape, dtype)``.
        native: whether the model is a native module (its names are torch's own).
        root: a module whose submodules own every parameter of this stage (the spec's whole
            module, whose other stages' parameters hold no storage; a native model's pieces):
            what ZeRO re-routes to its flat shards (``flat_shards.py``).
    """

    pieces: list[Piece]
    names_by_stage: list[tuple[str, ...]]
    shapes: dict[str, tuple[int, ...]]
    buffers: list[tuple[str, Any]]
    buffer_specs: dict[str, tuple[int, tuple[int, ...], np.dtype]]
    native: bool
    root: Any = None

    def params(self) -> list[tuple[str, Any, Callable, Callable]]:
        """This stage's parameters, each once (a tied parameter shared by two local chunks)."""
        seen: dict[str, tuple] = {}
        for piece in self.pieces:
            for entry in piece.params:
                seen.setdefault(entry[0], entry)
        return list(seen.values())


def _neutral_shape(p, from_torch) -> tuple[int, ...]:
    return tuple(np.shape(from_torch(np.empty(tuple(p.shape), np.float32))))


def cut_model(torch, model: Any, layout, stage: int, dtype, device=None,
              recompute: bool = False) -> CutModel:
    """The pieces of ``model`` that ``stage`` holds under the ``toolkit.Pipeline`` ``layout``,
    in ``dtype`` on ``device`` (only this stage's pieces move there); ``recompute``: each GPT
    block, hidden MLP layer or convolution of a spec model recomputes its activations in the
    backward pass (``models.layers.recomputing``)."""
    if isinstance(model, ModelSpec):
        return _on(torch, _cut_spec(torch, model, layout, stage, dtype, recompute), device)
    if isinstance(model, torch.nn.Sequential):
        return _on(torch, _cut_sequential(torch, model.to(dtype), layout, stage), device)
    if isinstance(model, torch.nn.Module):
        raise ToolkitError(f"horovod-torch cannot cut the native module {type(model).__name__} "
                           "into pipeline stages: it is not a torch.nn.Sequential",
                           SEQUENTIAL_ONLY)
    raise ToolkitError(f"horovod-torch cannot build a model from {type(model).__name__}",
                       SEQUENTIAL_ONLY)


def _on(torch, cut: CutModel, device) -> CutModel:
    """``cut`` with its pieces' modules, parameters and buffers on ``device``. ``Module.to``
    keeps the Parameter objects (a CPU and a CUDA tensor are compatible: it moves them in place),
    which the pieces' forwards and the optimizer hold, but puts new buffer tensors in the
    modules: ``cut.buffers`` is read again from them."""
    if device is None:
        return cut
    owner = {id(b): (m, name) for piece in cut.pieces for top in piece.modules
             for m in top.modules() for name, b in m._buffers.items() if b is not None}
    with torch.no_grad():
        for piece in cut.pieces:
            for module in piece.modules:
                module.to(device)
            for _, p, _, _ in piece.params:  # (a GPT's embeddings belong to no piece module)
                if p.device != device:
                    p.data = p.data.to(device)
    cut.buffers = [(name, getattr(*owner[id(b)])) for name, b in cut.buffers]
    return cut


def _cut_spec(torch, spec, layout, stage: int, dtype, recompute: bool) -> CutModel:
    from adapters.horovod_torch.models.spec import build_spec_model, recomputing
    from toolkit import CNN, GPT, MLP

    S, v = layout.stages, layout.chunks
    part = partition_model(spec, S, v, layout.splits or None)
    net, entries = build_spec_model(torch, spec)
    net.to(dtype)
    by_name = {e[0]: e for e in entries}
    shapes = {name: _neutral_shape(p, fr) for name, p, _, fr in entries}
    V = S * v

    def unit(call):  # a block's call: through the checkpoint only when recomputing
        return recomputing(torch, call, True) if recompute else call

    pieces = []
    for c in range(v):
        k = c * S + stage
        first, last, layers = k == 0, k == V - 1, part.layers[k]
        if isinstance(spec, GPT):
            forward, modules = _gpt_piece(torch, net, layers, first, last, unit)
        elif isinstance(spec, MLP):
            forward, modules = _mlp_piece(torch, spec, net, layers, unit)
        elif isinstance(spec, CNN):
            forward, modules = _cnn_piece(torch, net, layers, first, last, unit)
        else:  # pragma: no cover - every spec partition_model cuts is handled above
            raise ToolkitError(f"no pipeline pieces for {type(spec).__name__}", SEQUENTIAL_ONLY)
        params = [by_name[n] for n in part.names[k]]
        pieces.append(Piece(k, forward, params, modules))
    root = net
    if spec.__class__.__name__ == "GPT" and part.shared and stage == S - 1 and stage != 0:
        root = torch.nn.ModuleList([net, _untie_last(torch, pieces, by_name)])
    names = [part.names_on(s) for s in range(S)]
    return CutModel(pieces, names, shapes, [], {}, native=False, root=root)


def _untie_last(torch, pieces: list[Piece], by_name: dict):
    """The last stage's own copy of a tied ``tok_emb`` (another rank holds the first's): a
    separate Parameter, so the executor can sum both stages' gradients explicitly. Returned in
    the module that owns it (``table``), read by the head at call time."""
    name, original, to_torch, from_torch = by_name["tok_emb"]
    holder = torch.nn.Module()
    holder.table = copy = torch.nn.Parameter(original.detach().clone())
    for piece in pieces:
        piece.params = [(n, copy if n == name else p, t, f) for n, p, t, f in piece.params]
        if piece.forward.reads_table:
            piece.forward.own_table = holder
    return holder


def _gpt_piece(torch, net, layers: range, first: bool, last: bool, unit):
    F = torch.nn.functional
    blocks = [net.blocks[i] for i in layers]
    calls = [unit(b) for b in blocks]
    ln_f = net.ln_f if last else None
    tied = net.head is None

    # The parameters are read from the module at call time: ZeRO re-routes its attributes
    # to views of its flat shards (flat_shards.py).
    def forward(h):
        if first:
            h = F.embedding(h, table()) + net.pos_emb[:h.shape[1]]
        for call in calls:
            h = call(h)
        if last:
            f = ln_f(h)
            return F.linear(f, table()) if tied else f @ net.head.kernel
        return h

    def table():  # (the last stage's own copy of a tied table, or the module's)
        return net.tok_emb if forward.own_table is None else forward.own_table.table

    forward.reads_table, forward.own_table = first or (last and tied), None
    return forward, blocks + ([ln_f] if last else [])


def _mlp_piece(torch, spec, net, layers: range, unit):
    act = torch.relu if spec.activation == "relu" else torch.tanh
    mine = [(i, net.layers[i]) for i in layers]
    final = len(spec.sizes) - 2  # the model's last layer has no activation
    # a hidden layer and its activation: the recomputed unit (the last layer is none)
    calls = [unit(lambda x, layer=layer: act(layer(x))) if i < final else layer
             for i, layer in mine]

    def forward(x):
        for call in calls:
            x = call(x)
        return x

    return forward, [m for _, m in mine]


def _cnn_piece(torch, net, layers: range, first: bool, last: bool, unit):
    # units_of puts the head into the last conv's unit: the last piece ends with it.
    convs = [net.convs[i] for i in layers]
    calls = [unit(lambda x, conv=conv: torch.relu(conv(x))) for conv in convs]
    head = net.head if last else None

    def forward(x):
        if first:
            x = x.permute(0, 3, 1, 2)  # the spec's NHWC -> torch's NCHW
        for call in calls:
            x = call(x)
        if last:
            return head(x.permute(0, 2, 3, 1).reshape(len(x), -1))
        return x

    return forward, convs + ([head] if last else [])


def _cut_sequential(torch, net, layout, stage: int) -> CutModel:
    from adapters.horovod_torch.models.spec import same

    children = list(net.children())
    if len(children) != len(net._modules):
        raise ToolkitError("the nn.Sequential holds None entries", SEQUENTIAL_ONLY)
    if any(True for _ in net.named_parameters(recurse=False)):
        raise ToolkitError("the nn.Sequential has parameters of its own, outside its layers",
                           SEQUENTIAL_ONLY)
    costs = [sum(p.numel() for p in c.parameters()) for c in children]
    S, v = layout.stages, layout.chunks
    ranges = partition_layers(costs, S, v, layout.splits or None)
    # A parameter object that two layers share (a head tied to the embedding) has one name,
    # its first, as torch's named_parameters and data parallel's state give it: the stages
    # that hold it then hold the same name, and the executor sums their gradients as it does a
    # tied GPT's (or refuses the layout, naming it). Named per layer, each stage's copy would
    # train apart: a different model, silently.
    first_name = {id(p): n for n, p in net.named_parameters()}
    keys = list(net._modules)  # the Sequential's own names ("0", "1", ... or given ones)

    def entries(r: range):
        return [(first_name[id(p)], p, same, same) for i in r
                for p in children[i].parameters()]

    def buffers(r: range):
        return [(f"{keys[i]}.{n}", b) for i in r for n, b in children[i].named_buffers()
                if b is not None]

    shapes = {n: tuple(p.shape) for n, p, _, _ in entries(range(len(children)))}
    names = [tuple(n for c in range(v) for n, *_ in entries(ranges[c * S + s]))
             for s in range(S)]
    buffer_specs = {n: (k % S, tuple(b.shape), np.dtype(str(b.dtype).replace("torch.", "")))
                    for k, r in enumerate(ranges) for n, b in buffers(r)}
    pieces, mine = [], []
    for c in range(v):
        k = c * S + stage
        seq = torch.nn.Sequential(*(children[i] for i in ranges[k]))
        pieces.append(Piece(k, seq, entries(ranges[k]), [seq]))
        mine += buffers(ranges[k])
    root = torch.nn.ModuleList([m for piece in pieces for m in piece.modules])
    return CutModel(pieces, names, shapes, mine, buffer_specs, native=True, root=root)
