"""What the collectives of an XLA program carry: the bytes of each all-gather's, reduce-scatter's
and all-reduce's result, per device, by element type, read from HLO text.

:func:`partitioned_collectives` reads the program as the devices will run it once XLA has
placed its collectives (after SPMD partitioning: jit's all-gathers and reduce-scatters exist
only from there on), before any backend pass changes their types: XLA's CPU compiler widens
16-bit collectives to float32 (its ``float-normalization-bf16``), a GPU's keeps them."""

from __future__ import annotations

import pathlib
import re
from collections import Counter

KINDS = ("all-gather", "reduce-scatter", "all-reduce")

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
          "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
# "%name = TYPE all-gather(" or, for an asynchronous one, "%name = (...) all-gather-start(";
# TYPE is one array ("bf16[4,128]{1,0}") or a tuple of them ("(f32[8]{0}, f32[2]{0})").
_OP = re.compile(r"=\s+(\([^=]*?\)|\w+\[[\d,]*\](?:\{[^}]*\})?)\s+"
                 rf"({'|'.join(KINDS)})(-start)?\(")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")


def collective_bytes(hlo_text: str) -> dict[tuple[str, str], int]:
    """``(kind, element type) -> bytes`` over the program's collectives (one device's view:
    the bytes of what each collective produces). An asynchronous ``-start`` op's tuple holds
    its operand and its result: only the result (the last array) is counted."""
    totals: Counter = Counter()
    for result, kind, start in _OP.findall(hlo_text):
        arrays = _ARRAY.findall(result)
        if start:
            arrays = arrays[-1:]
        for dtype, dims in arrays:
            size = 1
            for d in filter(None, dims.split(",")):
                size *= int(d)
            totals[(kind, dtype)] += size * _BYTES[dtype]
    return dict(totals)


def partitioned_collectives(lowered, directory) -> dict[tuple[str, str], int]:
    """:func:`collective_bytes` of ``lowered`` (a ``jax.jit(f).lower(...)`` or
    ``jax.pmap(f).lower(...)``) after SPMD partitioning, compiled once with XLA's HLO dump into
    ``directory``; a pmap program, which has no such pass, as lowered."""
    lowered.compile(compiler_options={"xla_dump_to": str(directory),
                                      "xla_dump_hlo_pass_re": "spmd-partitioning"})
    dumps = sorted(pathlib.Path(directory).glob("*after_spmd-partitioning*.txt"))
    return collective_bytes(dumps[-1].read_text() if dumps else lowered.as_text(dialect="hlo"))
