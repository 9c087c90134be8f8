"""What the collectives of a compiled XLA program carry, read from its optimised HLO text
(``jax.jit(f).lower(...).compile().as_text()``): the bytes of each all-gather's result, each
reduce-scatter's result and each all-reduce's operand, per device, by element type. It reads
the program XLA runs, so a cast the compiler moved across a gather is counted where it ran."""

from __future__ import annotations

import re
from collections import Counter

KINDS = ("all-gather", "reduce-scatter", "all-reduce")

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
          "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
# "%name = TYPE all-gather(" or, for an asynchronous one, "%name = (...) all-gather-start(";
# TYPE is one array ("bf16[4,128]{1,0}") or a tuple of them ("(f32[8]{0}, f32[2]{0})").
_OP = re.compile(r"=\s+(\([^=]*?\)|\w+\[[\d,]*\](?:\{[^}]*\})?)\s+"
                 r"(all-gather|reduce-scatter|all-reduce)(-start)?\(")
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
