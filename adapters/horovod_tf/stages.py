"""A model cut into pipeline pieces for the ``horovod-tf`` backend (``pipeline.py``).

Spec models (``toolkit.MLP``, ``CNN``, ``GPT``) are cut by ``toolkit.partition_model`` into runs of
whole units (an MLP's layers, a CNN's convs, a GPT's blocks with the embeddings on the first piece
and ``ln_f``/head on the last). A piece runs its units with the same TF ops as the data-parallel
model (``models/units.unit_functions``: ``models/spec.spec_forward`` unit by unit), on
``tf.Variable``\\ s under the spec's neutral names made from the same numpy initialisation, of
which a rank creates its stage's only. With ``recompute`` (activation checkpointing) each GPT block
and hidden MLP layer of a piece runs under ``tf.recompute_grad`` as in data parallel
(``models/layers.checkpointed``): the tape a forward keeps until its backward holds their inputs,
not their insides. A tied GPT's last stage holds its own ``tok_emb`` variable (the head reads
it); the executor sums both stages' gradients, so both copies take the same update (Megatron-LM's
embedding group).

A Keras ``Sequential`` is cut by layer index (balanced by trainable parameter count, or at the
layout's split points), its variables under ``models/keras_native.py``'s stable names; every
other model (a functional or subclassed Keras model, anything else) is refused: a pipeline
needs a sequential model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from adapters.horovod_tf.models.layers import float32_products
from toolkit import ToolkitError
from toolkit.models.specs import ModelSpec
from toolkit.parallel.pipeline.partition import partition_layers, partition_model

SEQUENTIAL_ONLY = ("a pipeline needs a sequential model, cut into consecutive pieces: pass a "
                   "toolkit.MLP/CNN/GPT spec, or a keras.Sequential (cut by layer index)")


class Piece(NamedTuple):
    """Piece ``index`` (virtual stage ``k``: stage ``k % S``, local chunk ``k // S``): its
    ``forward(h, training)`` from its input (the model's on piece 0, else the previous piece's
    output) to its output, and its parameters' ``names`` (keys of ``CutModel.variables``)."""

    index: int
    forward: Callable[[Any, bool], Any]
    names: tuple[str, ...]


@dataclasses.dataclass
class CutModel:
    """The pieces one stage holds, its variables, and the full model's catalogue of names.

    Attributes:
        pieces: this stage's pieces by local chunk.
        variables: this stage's trainable variables by neutral name, in the model's order.
        names_by_stage: every stage's parameter names (a tied parameter on two stages).
        shapes: every parameter's shape, in the model's order.
        buffers: this stage's non-trainable variables, ``(name, variable)``; ``buffer_specs``:
            every stage's as ``name -> (stage, shape, dtype)``.
        keras: the ``models.keras_native.KerasNative`` of a Keras model, else ``None``.
    """

    pieces: list[Piece]
    variables: dict[str, Any]
    names_by_stage: list[tuple[str, ...]]
    shapes: dict[str, tuple[int, ...]]
    buffers: list[tuple[str, Any]]
    buffer_specs: dict[str, tuple[int, tuple[int, ...], np.dtype]]
    keras: Any = None

    @property
    def native(self) -> bool:
        return self.keras is not None


def cut_model(tf, model: Any, layout, stage: int, runtime, seed: int,
              recompute: bool = False, cast: Callable = lambda tree: tree,
              precision: Any = None) -> CutModel:
    """The pieces of ``model`` that ``stage`` holds under the ``toolkit.Pipeline`` ``layout``
    (``runtime``: the started ``TFRuntime``, for its dtype and rank 0's broadcast; ``seed``
    initialises a spec; ``recompute``: a spec's blocks and hidden layers recompute their
    activations in the backward pass, ``adapters._common.check_recompute`` having refused it
    for any other model; ``cast``: a spec piece's variables and input in the compute dtype,
    ``ops.TFOps.in_compute``, under mixed precision; a Keras model's layers take the Keras
    policy of ``precision`` instead: ``keras_native.apply_precision``)."""
    if isinstance(model, ModelSpec):
        return _cut_spec(tf, model, layout, stage, model.init(seed, runtime.dtype_name),
                         recompute, cast)
    try:
        import keras
    except ImportError:  # pragma: no cover - horovod-tf installs Keras with TensorFlow
        keras = None
    if keras is not None and isinstance(model, keras.Sequential):
        return _cut_sequential(tf, model, layout, stage, runtime, precision)
    if keras is not None and isinstance(model, keras.Layer):
        raise ToolkitError(f"horovod-tf cannot cut the Keras model {model.name!r} "
                           f"({type(model).__name__}) into pipeline stages: it is not a "
                           "keras.Sequential", SEQUENTIAL_ONLY)
    raise ToolkitError(f"horovod-tf cannot build a pipeline from {type(model).__name__}",
                       SEQUENTIAL_ONLY)


def compiled_pieces(tf, cut: CutModel, loss: Callable,
                    last: Callable[[int], bool]) -> tuple[list[Callable], dict[int, Callable]]:
    """``(forwards, loss_of)``: each of ``cut``'s pieces' ``forward(h, training)`` as a
    ``tf.function`` by local chunk, and for each chunk ``c`` that ``last(c)`` its forward ending
    with ``loss(output, y)``: ``loss_of[c](h, y, training)``. A spec piece takes the stage's
    parameters as a last argument where no variable holds them (pipeline x ZeRO-3).

    A tape differentiates a ``tf.function`` call with its compiled gradient. A spec model's
    pieces go through XLA: TF's own kernels took 91 ms for the backward of a 2048 x 2048 and a
    2048 x 10 layer on 64 samples, XLA 39 ms (one core); a Keras model's keep TF's kernels
    (their layers may hold ops XLA does not compile). The loss is inside the last piece's
    function: run eagerly, its ops made the last stage's backward 8 ms slower than the first's.
    """
    def compiled(fn):
        return tf.function(fn, reduce_retracing=True, jit_compile=not cut.native)

    def with_loss(forward):
        return lambda h, y, training, *params: loss(forward(h, training, *params), y)

    return ([compiled(p.forward) for p in cut.pieces],
            {c: compiled(with_loss(p.forward)) for c, p in enumerate(cut.pieces) if last(c)})


def _cut_spec(tf, spec, layout, stage: int, init: dict[str, np.ndarray],
              recompute: bool, cast: Callable) -> CutModel:
    from adapters.horovod_tf.models.units import unit_functions

    S, v = layout.stages, layout.chunks
    part = partition_model(spec, S, v, layout.splits or None)
    units = unit_functions(tf, spec, part.layers[-1].stop, recompute)
    mine = part.names_on(stage)
    variables = {n: tf.Variable(a, name=n.replace(".", "_")) for n, a in init.items()
                 if n in mine}  # a tied tok_emb on the last stage: that stage's own variable
    pieces = []
    for c in range(v):
        k = c * S + stage
        pieces.append(Piece(k, _spec_forward([units[i][0] for i in part.layers[k]], variables,
                                             k == 0, cast), part.names[k]))
    return CutModel(pieces, variables, [part.names_on(s) for s in range(S)],
                    {n: tuple(a.shape) for n, a in init.items()}, [], {})


def _spec_forward(fns: list[Callable], variables: dict, first: bool,
                  cast: Callable) -> Callable:
    """The units ``fns`` (``fn(params, h, x)``, the first unit of the model reading ``x``) one
    after the other; a later piece's input is its ``h`` (and its ``x``: a GPT block reads the
    batch and sequence sizes from it). The variables and the input go through ``cast``."""

    def forward(h, training: bool = True, params: dict | None = None):
        del training  # the spec models have no dropout or batch statistics
        # (params: the stage's gathered parameters under ZeRO-3, in the variables' place)
        h, params = cast(h), cast(variables if params is None else params)
        x, out = h, None if first else h
        with float32_products():  # (an XLA cluster: no fused bias, models/layers.py)
            for fn in fns:
                out = fn(params, out, x)
        return out

    return forward


def _cut_sequential(tf, model, layout, stage: int, runtime, precision: Any) -> CutModel:
    from adapters.horovod_tf.models.keras_native import KerasNative, _np_dtype
    from adapters.horovod_tf.ops import TFState

    native = KerasNative(model, runtime.dtype_name, "horovod-tf", precision)
    whole = TFState(tf, native=True)  # rank 0's initial values on every rank, then cut
    whole.vars, whole.buffers = native.params, native.buffers
    whole.broadcast(runtime.hvd)
    layers = list(model.layers)
    if not layers:
        raise ToolkitError(f"the keras.Sequential {model.name!r} has no layers", SEQUENTIAL_ONLY)
    param_name = {id(var): n for n, var in native.params.items()}
    buffer_name = {id(var): n for n, var in native.buffers.items()}

    def names(r: range, table: dict) -> list[str]:
        return [table[id(var)] for i in r for var in layers[i].variables if id(var) in table]

    costs = [sum(int(np.prod(var.shape)) for var in layer.trainable_variables)
             for layer in layers]
    S, v = layout.stages, layout.chunks
    ranges = partition_layers(costs, S, v, layout.splits or None)
    names_by_stage = [tuple(n for c in range(v) for n in names(ranges[c * S + s], param_name))
                      for s in range(S)]
    buffer_specs = {n: (k % S, tuple(native.buffers[n].shape), _np_dtype(native.buffers[n]))
                    for k, r in enumerate(ranges) for n in names(r, buffer_name)}
    pieces, buffers = [], []
    for c in range(v):
        k = c * S + stage
        pieces.append(Piece(k, _keras_forward([layers[i] for i in ranges[k]]),
                            tuple(names(ranges[k], param_name))))
        buffers += [(n, native.buffers[n]) for n in names(ranges[k], buffer_name)]
    mine = names_by_stage[stage]
    variables = {n: var for n, var in native.params.items() if n in mine}
    shapes = {n: tuple(var.shape) for n, var in native.params.items()}
    return CutModel(pieces, variables, names_by_stage, shapes, buffers, buffer_specs, native)


def _keras_forward(layers: list) -> Callable:
    def forward(h, training: bool = True):
        for layer in layers:
            h = layer(h, training=training)
        return h

    return forward
