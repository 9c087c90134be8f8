"""The flat-shard arithmetic of ZeRO / FSDP (numpy only): its errors, dtypes and input shapes.

The round trips of shard, gather and owned over random shapes are in test_layouts.py."""

from __future__ import annotations

import numpy as np
import pytest

from toolkit.errors import ToolkitError
from toolkit.parallel.shards import FlatLayout

_SHAPES = {"a": (2, 3), "b": (5,)}  # 11 elements over 3 ranks: shards of 4, 1 of padding


@pytest.mark.parametrize("call, message", [
    (lambda lay: FlatLayout.from_shapes(_SHAPES, 0),
     "world size 0 must be a positive integer\nHINT: shard over 1 or more ranks"),
    (lambda lay: FlatLayout.from_shapes(_SHAPES, True),
     "world size True must be a positive integer\nHINT: shard over 1 or more ranks"),
    (lambda lay: FlatLayout.from_shapes(_SHAPES, 2.0),
     "world size 2.0 must be a positive integer\nHINT: shard over 1 or more ranks"),
    (lambda lay: FlatLayout.from_shapes({}, 2),
     "no parameters to shard\nHINT: pass at least one name -> shape"),
    (lambda lay: lay.owned(3),
     "rank 3 is outside a world of 3\nHINT: ranks are 0 to 2"),
    (lambda lay: lay.shard(_arrays(), -1),
     "rank -1 is outside a world of 3\nHINT: ranks are 0 to 2"),
    (lambda lay: FlatLayout.from_shapes({k: (1,) for k in "pqrs"}, 2).flatten({}),
     "arrays lack parameters ['p', 'q', 'r']\n"
     "HINT: pass every parameter the layout was built from"),
    (lambda lay: lay.flatten({"a": np.zeros((3, 2)), "b": np.zeros(5)}),
     "parameter a has shape (3, 2), the layout expects (2, 3)\n"
     "HINT: build the layout from the same shapes as the arrays"),
    (lambda lay: lay.unflatten(np.zeros(10)),
     "flat buffer has 10 elements, expected 12\n"
     "HINT: pass the output of flatten() or the concatenated shards"),
    (lambda lay: lay.gather([np.zeros(4), np.zeros(4), np.zeros(3)]),
     "gather needs 3 shards of 4 elements, got [4, 4, 3]\n"
     "HINT: pass every rank's shard, in rank order"),
])
def test_flat_layout_errors_name_the_value_and_say_what_to_do(call, message):
    with pytest.raises(ToolkitError) as err:
        call(FlatLayout.from_shapes(_SHAPES, 3))
    assert str(err.value) == message


def _arrays(dtype=np.float64):
    return {"a": np.arange(6).reshape(2, 3).astype(dtype), "b": np.arange(6, 11).astype(dtype)}


def test_the_flat_buffer_keeps_the_parameters_dtype():
    layout = FlatLayout.from_shapes(_SHAPES, 3)
    for dtype in (np.float16, np.float32, np.int32):
        assert layout.flatten(_arrays(dtype)).dtype == dtype
        assert layout.shard(_arrays(dtype), 1).dtype == dtype
    mixed = {"a": _arrays(np.float16)["a"], "b": _arrays(np.float32)["b"]}
    assert layout.flatten(mixed).dtype == np.float32  # the common type: nothing is rounded
    assert layout.shard(mixed, 2).dtype == np.float32


def test_buffers_of_any_shape_are_read_flat():
    """A host copy of a device buffer may come back as a row or a column: its elements count,
    in order."""
    layout = FlatLayout.from_shapes(_SHAPES, 3)
    arrays = _arrays()
    flat = layout.flatten(arrays)
    np.testing.assert_array_equal(flat, np.r_[np.arange(11.0), 0.0])
    for back in (layout.unflatten(flat.reshape(-1, 1)), layout.unflatten(flat[:11].reshape(1, -1)),
                 layout.gather([layout.shard(arrays, r).reshape(-1, 1) for r in range(3)]),
                 layout.gather([layout.shard(arrays, r).reshape(1, -1) for r in range(3)])):
        assert list(back) == ["a", "b"]
        for name in arrays:
            np.testing.assert_array_equal(back[name], arrays[name])
