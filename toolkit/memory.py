"""Per-rank training memory of each parallel layout: ``python -m toolkit.memory --help``.

Bytes per parameter (``dtype``; ``mixed`` is the ZeRO paper's mixed-precision training):

============  ==========  =========  ==========================================================
dtype         parameters  gradients  optimizer state (sgd / momentum / adam / adam-master)
============  ==========  =========  ==========================================================
float32       4           4          0 / 4 / 8 / 12
float16       2           2          0 / 2 / 4 / 6 (states kept in 16 bits)
bfloat16      2           2          0 / 2 / 4 / 6
mixed         2           2          4 / 8 / 12 / 12 (fp32 master copy + fp32 states: K)
bf16-mixed    4           4          0 / 4 / 8 / 8 (the toolkit's: float32 parameters cast)
fp16-mixed    4           4          0 / 4 / 8 / 8 (on the fly, no 16-bit copy kept)
============  ==========  =========  ==========================================================

``bf16-mixed`` and ``fp16-mixed`` are this toolkit's policies (``--precision``,
docs/precision.md): the parameters, gradients and optimizer state stay float32 (no separate
master copy: the parameters are the master), the forward pass casts them on the fly, so only
the activations are 16-bit. ``mixed`` is the ZeRO paper's accounting, with a 16-bit copy of the
parameters and gradients kept beside the float32 master and states.

``adam`` keeps the two moments (what ``torch.optim.Adam`` allocates); ``adam-master`` also
counts a full-precision master copy of the parameters. That is the ZeRO paper's ``K = 12`` for
mixed precision, and how the C-DAC course counts fp32 Adam: 1.5B parameters give 6 GB of
parameters, 6 GB of gradients and 18 GB of "Adam states" (12 bytes per parameter).

Per rank, with ``N`` ranks: data parallel replicates everything; ZeRO stage 1 divides the
optimizer state by ``N``, stage 2 also the gradients, stage 3 also the parameters (the ZeRO
paper's 7.5B parameters on 64 ranks, mixed: 120 / 31.4 / 16.6 / 1.9 GB). ``Sharded`` with
``tensor_parallel = t`` first divides the parameter state by ``t``, then shards it over the
``N / t`` data-parallel ranks. A pipeline of ``S`` stages (balanced) holds ``1/S`` of the
parameter state and ``1/S`` of the layers' activations for each micro-batch in flight at its
first stage: ``M`` under GPipe, ``min(S, M)`` under 1F1B (interleaved 1F1B counted like 1F1B).
A composed layout (``pipeline:2:4+sharded:3+tensor:2+replicate:2``, ``toolkit.ParallelDims``)
divides the parameter state by its stages and tensor parts, then ZeRO shards a rank's part over
its data-parallel group only: the replicas (HSDP) hold copies.

Activations (saved for the backward pass, no recomputation, 4 bytes an element in float32 and 2
otherwise), for a micro-batch of ``B`` sequences of ``T`` tokens, width ``d``, ``H`` heads:

- ``full`` (default): per block ``B*T*(16*d + H*T)`` elements: Korthikanti et al. (2022)'s
  ``34*B*T*d + 5*H*T*T*B`` bytes in 16 bits without the dropout masks and outputs our GPT does
  not have: LayerNorm inputs ``2d``, the q, k, v and attention output ``4d``, projection input
  ``d``, MLP input ``d``, GELU input and output ``8d``, and the softmax probabilities ``H*T``.
- ``rough``: per block ``6*B*T*d`` elements, the rule of thumb the ZeRO paper's "about 60 GB"
  and the course's "about 56 GB" for GPT-2 XL (48 blocks, d = 1600, batch 32 x 1024, fp32) come
  from: ``48*32*1024*1600*6*4`` = 60.4e9 bytes = 56.25 GiB (the course's GB are GiB here).
- an MLP saves ``B * (sizes[0] + 2*sum(hidden sizes) + sizes[-1])`` elements.

Embedding and logit activations are left out. GB are 1e9 bytes, GiB 2**30 bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from toolkit.errors import ToolkitError
from toolkit.parallel.layouts import Layout, parse_layout

DTYPES = ("float32", "float16", "bfloat16", "mixed", "bf16-mixed", "fp16-mixed")
OPTIMIZERS = ("sgd", "momentum", "adam", "adam-master")
ACTIVATION_MODELS = ("full", "rough")
_STATE_COPIES = {"sgd": 0, "momentum": 1, "adam": 2, "adam-master": 3}


def _check(kind: str, value: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ToolkitError(f"unknown {kind} {value!r}", f"use one of: {', '.join(valid)}")


def bytes_per_param(dtype: str, optimizer: str) -> tuple[int, int, int]:
    """``(parameter, gradient, optimizer state)`` bytes per parameter, unsharded."""
    _check("dtype", dtype, DTYPES)
    _check("optimizer", optimizer, OPTIMIZERS)
    if dtype == "mixed":  # fp32 master copy + fp32 states, K in the ZeRO paper
        return 2, 2, 4 + 4 * min(2, _STATE_COPIES[optimizer])
    if dtype.endswith("-mixed"):  # the toolkit's: float32 master parameters, cast on the fly
        return 4, 4, 4 * min(2, _STATE_COPIES[optimizer])
    size = 4 if dtype == "float32" else 2
    return size, size, size * _STATE_COPIES[optimizer]


def activation_element_bytes(dtype: str) -> int:
    _check("dtype", dtype, DTYPES)
    return 4 if dtype == "float32" else 2


def default_heads(width: int) -> int:
    """GPT-2's 64-wide heads where the width allows, else one head."""
    return width // 64 if width % 64 == 0 else 1


def gpt_activation_bytes(layers: int, width: int, context: int, batch: int, heads: int | None,
                         dtype: str = "float32", model: str = "full",
                         recompute: bool = False) -> int:
    """Activations a GPT's blocks save for one micro-batch of ``batch`` sequences; with
    ``recompute`` (activation checkpointing) each block keeps its input only, and one block's
    activations live again while its backward runs."""
    _check("activation model", model, ACTIVATION_MODELS)
    heads = heads or default_heads(width)
    per_token = 16 * width + heads * context if model == "full" else 6 * width
    if recompute:
        return (layers * width + per_token) * batch * context * activation_element_bytes(dtype)
    return layers * batch * context * per_token * activation_element_bytes(dtype)


def mlp_activation_bytes(sizes: tuple[int, ...], batch: int, dtype: str = "float32") -> int:
    """Activations an MLP saves for one micro-batch of ``batch`` examples."""
    elements = sizes[0] + 2 * sum(sizes[1:-1]) + sizes[-1]
    return batch * elements * activation_element_bytes(dtype)


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds (the most loaded rank: a pipeline's first stage). ``gathered``:
    what a pipeline's ZeRO stage holds besides while a step runs, gathering once per step
    (``gather=step``): the stage's whole parameters (ZeRO-3) and whole gradient sum (ZeRO-2
    and 3) until the step's end; per micro-batch it is about one unit's, not counted."""

    params: float
    grads: float
    optimizer: float
    activations: float
    gathered: float = 0.0

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations

    @property
    def model_states(self) -> float:
        """Parameters, gradients and optimizer state: what ZeRO shards."""
        return self.params + self.grads + self.optimizer


def estimate(num_params: int, layout: Layout, world_size: int, dtype: str = "float32",
             optimizer: str = "adam", activations: float = 0) -> MemoryEstimate:
    """Per-rank bytes of ``num_params`` parameters trained under ``layout`` on ``world_size``
    ranks; ``activations`` are the whole model's activation bytes for one micro-batch."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ToolkitError(f"world size {world_size!r} must be a positive integer",
                           "e.g. --world-size 8")
    if num_params < 1:
        raise ToolkitError(f"{num_params} parameters: need at least one",
                           "give --params or a model")
    per_param = bytes_per_param(dtype, optimizer)
    p, g, o = (num_params * b for b in per_param)
    dims = getattr(layout, "dims", None)
    if dims is None:
        raise ToolkitError(f"unknown layout {layout!r}",
                           "use DataParallel, Sharded, Pipeline or ParallelDims")
    t, s = dims.tensor, dims.stages
    if world_size % t:
        raise ToolkitError(f"world size {world_size} is not a multiple of the "
                           f"tensor-parallel size {t}", f"use a multiple of {t} ranks")
    if world_size % s:
        raise ToolkitError(f"world size {world_size} is not a multiple of the {s} "
                           "pipeline stages", f"use S x D ranks, e.g. --world-size {s}")
    n = dims.grid(world_size).extent("data")  # the ranks a ZeRO stage shards over
    # each stage (balanced) holds 1/S of the state, each tensor part 1/T of it; ZeRO then
    # shards what a rank holds over its data-parallel group (not over the replicas: HSDP)
    p, g, o = p / (s * t), g / (s * t), o / (s * t)
    z = dims.zero
    if dims.pipeline is not None:
        m = dims.pipeline.micro_batches
        in_flight = m if dims.pipeline.schedule == "gpipe" else min(s, m)
        activations = activations / s * in_flight
    gathered = 0.0
    if dims.pipeline is not None and z >= 2 and dims.gather == "step":
        gathered = (p if z >= 3 else 0.0) + g
    return MemoryEstimate(p / n if z >= 3 else p, g / n if z >= 2 else g,
                          o / n if z >= 1 else o, activations, gathered)


def human(n: float) -> str:
    """``n`` bytes in GB (1e9) or MB (1e6), with GiB alongside."""
    if n >= 1e9:
        return f"{n / 1e9:.2f} GB ({n / 2**30:.2f} GiB)"
    return f"{n / 1e6:.2f} MB ({n / 2**20:.2f} MiB)"


def format_table(est: MemoryEstimate) -> str:
    rows = [("parameters", est.params), ("gradients", est.grads),
            ("optimizer state", est.optimizer), ("activations", est.activations),
            ("total", est.total)]
    if est.gathered:  # (a pipeline's ZeRO stage gathering once per step)
        rows += [("gathered in step", est.gathered), ("peak in a step", est.total + est.gathered)]
    lines = [f"{'per rank':<16} {'bytes':>16}  human (GB = 1e9 bytes, GiB = 2**30 bytes)"]
    lines += [f"{name:<16} {value:>16,.0f}  {human(value)}" for name, value in rows]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m toolkit.memory", description="Per-rank training memory of a layout.",
        epilog="Example: python -m toolkit.memory --params 7.5e9 --dtype mixed "
               "--layout sharded:3 --world-size 64")
    parser.add_argument("--model", choices=("gpt", "mlp", "cnn"),
                        help="count the parameters of a spec")
    parser.add_argument("--params", type=float, help="parameter count, instead of --model")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--width", type=int)
    parser.add_argument("--context", type=int)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--heads", type=int, help="default: width / 64 (1 if not a multiple)")
    parser.add_argument("--sizes", help="MLP widths, e.g. 64,128,10")
    parser.add_argument("--image", default="8,8,1", help="CNN input height,width,channels")
    parser.add_argument("--channels", help="CNN convolution channels, e.g. 8,16")
    parser.add_argument("--classes", type=int, default=10, help="CNN outputs")
    parser.add_argument("--batch", type=int, default=1, help="per-rank micro-batch (sequences)")
    parser.add_argument("--dtype", default="float32", help=" | ".join(DTYPES))
    parser.add_argument("--precision", choices=("32", "bf16-mixed", "fp16-mixed"), default=None,
                        help="a toolkit precision policy (docs/precision.md), instead of --dtype")
    parser.add_argument("--optimizer", default="adam", help=" | ".join(OPTIMIZERS))
    parser.add_argument("--activations", default="full", help=" | ".join(ACTIVATION_MODELS))
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="a GPT's blocks keep their inputs only (docs/memory.md)")
    parser.add_argument("--layout", default="data",
                        help="data | sharded:1|2|3 | pipeline:S:M, or dimensions joined with +: "
                             "pipeline:S:M+sharded:Z[:gather=micro-batch], sharded:Z+replicate:R")
    parser.add_argument("--world-size", type=int, default=1)
    return parser.parse_args(argv)


def _count(args: argparse.Namespace) -> tuple[int, float, str]:
    """Parameters, one micro-batch's activation bytes and a description of the model."""
    from toolkit.models.gpt import GPT
    from toolkit.models.specs import MLP

    if args.batch < 1:
        raise ToolkitError(f"--batch {args.batch} must be positive", "e.g. --batch 8")
    if args.model == "gpt":
        if None in (args.layers, args.width, args.context):
            raise ToolkitError("--model gpt needs --layers, --width and --context",
                               "e.g. --layers 48 --width 1600 --context 1024 --vocab 50257")
        heads = args.heads or default_heads(args.width)
        spec = GPT(vocab=args.vocab, context=args.context, width=args.width,
                   layers=args.layers, heads=heads)
        acts = gpt_activation_bytes(spec.layers, spec.width, spec.context, args.batch, heads,
                                    args.dtype, args.activations,
                                    args.activation_checkpointing)
        return spec.num_params, acts, repr(spec)
    if args.model == "mlp":
        if not args.sizes:
            raise ToolkitError("--model mlp needs --sizes", "e.g. --sizes 64,128,10")
        try:
            spec = MLP(tuple(int(s) for s in args.sizes.split(",")))
        except ValueError:
            raise ToolkitError(f"--sizes {args.sizes!r} is not a list of integers",
                               "e.g. --sizes 64,128,10") from None
        params = sum(a * b + b for a, b in zip(spec.sizes[:-1], spec.sizes[1:], strict=True))
        return params, mlp_activation_bytes(spec.sizes, args.batch, args.dtype), repr(spec)
    if args.model == "cnn":
        return _count_cnn(args)
    if args.params is None:
        raise ToolkitError("no model given",
                           "pass --model gpt|mlp|cnn with its sizes, or --params")
    acts = 0
    if None not in (args.layers, args.width, args.context):
        acts = gpt_activation_bytes(args.layers, args.width, args.context, args.batch,
                                    args.heads, args.dtype, args.activations)
    return int(args.params), acts, f"{int(args.params):,} parameters"


def _count_cnn(args: argparse.Namespace) -> tuple[int, float, str]:
    """A CNN spec's parameters (from its real initial arrays' sizes) and activations: every
    convolution's input and output maps, the head's input and output."""
    from toolkit.models.specs import CNN

    try:
        image = tuple(int(v) for v in args.image.split(","))
        channels = tuple(int(v) for v in (args.channels or "").split(","))
    except ValueError:
        raise ToolkitError(f"--image {args.image!r} / --channels {args.channels!r} must be "
                           "lists of integers", "e.g. --image 8,8,1 --channels 8,16") from None
    spec = CNN(image_shape=image, channels=channels, classes=args.classes)
    params = sum(a.size for a in spec.init(0).values())
    h, w, c = spec.image_shape
    elements = h * w * (c + 2 * sum(spec.channels)) + spec.classes
    return params, args.batch * elements * activation_element_bytes(args.dtype), repr(spec)


def main(argv: list[str] | None = None) -> int:
    """Prints the per-rank memory table; bad input raises a ToolkitError."""
    args = parse_args(argv)
    if args.precision is not None:
        args.dtype = "float32" if args.precision == "32" else args.precision
    layout = parse_layout(args.layout)
    num_params, acts, described = _count(args)
    est = estimate(num_params, layout, args.world_size, args.dtype, args.optimizer, acts)
    ranks = f"{args.world_size} rank{'' if args.world_size == 1 else 's'}"
    print(f"{described}; {layout.name} on {ranks}; {args.dtype}, "
          f"{args.optimizer}; micro-batch {args.batch}; activations: {args.activations}"
          + ("" if acts else " (not counted: give --layers, --width and --context)"))
    print(format_table(est))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ToolkitError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
