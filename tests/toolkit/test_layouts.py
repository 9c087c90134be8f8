"""Layout specs and the flat-shard arithmetic of ZeRO / FSDP (numpy only)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from toolkit.errors import ToolkitError
from toolkit.models.gpt import GPT
from toolkit.models.specs import MLP
from toolkit.parallel.layouts import (
    DataParallel,
    DataShare,
    ParallelDims,
    Pipeline,
    Sharded,
    parse_layout,
)
from toolkit.parallel.shards import FlatLayout, unit_layouts, units_of


def test_names_round_trip_through_parse_layout():
    layouts = [DataParallel(), Sharded(1), Sharded(2), Sharded(3), Sharded(3, 2),
               Pipeline(2, 4), Pipeline(4, 8, "gpipe"), Pipeline(4, 8, "interleaved-1f1b", 2),
               Pipeline(2, 4, within_node="replicas"),
               Pipeline(4, 8, "interleaved-1f1b", 2, within_node="replicas")]
    for layout in layouts:
        assert parse_layout(layout.name) == layout
    assert DataParallel().name == "data_parallel"
    assert Sharded(3).name == "sharded:3"
    assert Pipeline(2, 4).name == "pipeline:2:4:1f1b"
    assert parse_layout("data") == DataParallel()
    assert parse_layout("sharded:2") == Sharded(stage=2)
    assert parse_layout("pipeline:2:4") == Pipeline(stages=2, micro_batches=4, schedule="1f1b")
    # which axis stays within a node: said only when it is not the default
    assert Pipeline(2, 4, within_node="stages").name == "pipeline:2:4:1f1b"
    assert Pipeline(2, 4, "gpipe", within_node="replicas").name == (
        "pipeline:2:4:gpipe:within-node=replicas")
    for text in ("pipeline:2:4:within-node=replicas", "pipeline:2:4:1f1b:within_node=replicas",
                 "Pipeline:2:4:1F1B:Within-Node=Replicas"):
        assert parse_layout(text) == Pipeline(2, 4, within_node="replicas"), text
    assert parse_layout("pipeline:2:4:1f1b:within-node=stages") == Pipeline(2, 4)


def test_layouts_are_frozen():
    with pytest.raises(AttributeError):
        Sharded(1).stage = 2


@pytest.mark.parametrize("make, words", [
    (lambda: Sharded(4), ["stage=4", "HINT", "1 (optimizer state)"]),
    (lambda: Sharded(0), ["stage=0"]),
    (lambda: Sharded(True), ["stage=True"]),
    (lambda: Sharded(1, tensor_parallel=0), ["tensor_parallel=0"]),
    (lambda: Pipeline(0, 4), ["stages=0"]),
    (lambda: Pipeline(2, -1), ["micro_batches=-1"]),
    (lambda: Pipeline(2, 4, "zb-h1"), ["'zb-h1'", "gpipe, 1f1b, interleaved-1f1b"]),
    (lambda: Pipeline(2, 4, "1f1b", chunks=2), ["chunks=2", "interleaved-1f1b"]),
    (lambda: Pipeline(2.5, 4), ["stages=2.5"]),
    (lambda: Pipeline(2, 4, within_node="data"), ["within_node='data'", "HINT: use 'stages'"]),
])
def test_invalid_layouts_name_the_value(make, words):
    with pytest.raises(ToolkitError) as err:
        make()
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize("text, word", [
    ("tensor", "unknown layout 'tensor'"), ("sharded:4", "stage=4"),
    ("sharded:x", "stage 'x' is not an integer"), ("sharded", "unknown layout"),
    ("pipeline:2", "unknown layout"), ("pipeline:2:0", "micro_batches=0"),
    ("pipeline:2:4:foo", "'foo'"), ("data:2", "unknown layout"),
])
def test_parse_layout_errors(text, word):
    with pytest.raises(ToolkitError) as err:
        parse_layout(text)
    assert word in str(err.value)
    assert "HINT" in str(err.value)


def _random_shapes(rng):
    shapes = {}
    for i in range(rng.integers(1, 6)):
        ndim = rng.integers(0, 4)
        shapes[f"p{i}"] = tuple(int(d) for d in rng.integers(1, 7, ndim))
    return shapes


@pytest.mark.parametrize("world_size", range(1, 8))
@pytest.mark.parametrize("seed", range(12))
def test_shard_gather_round_trip(world_size, seed):
    rng = np.random.default_rng(seed * 10 + world_size)
    shapes = _random_shapes(rng)
    arrays = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
    layout = FlatLayout.from_shapes(shapes, world_size)
    assert layout.total == sum(a.size for a in arrays.values())
    assert layout.padded % world_size == 0
    assert 0 <= layout.padded - layout.total < world_size
    shards = [layout.shard(arrays, r) for r in range(world_size)]
    assert {len(s) for s in shards} == {layout.shard_size}
    back = layout.gather(shards)
    assert list(back) == list(shapes)
    for name in shapes:
        assert back[name].dtype == arrays[name].dtype
        np.testing.assert_array_equal(back[name], arrays[name])
    flat = layout.flatten(arrays)
    np.testing.assert_array_equal(np.concatenate(shards), flat)
    assert not flat[layout.total:].any()
    # owned() covers every element of every parameter exactly once, in flat order
    seen = {name: np.zeros(int(np.prod(s)), int) for name, s in shapes.items()}
    for r in range(world_size):
        at = 0
        for name, a, b, shard_start in layout.owned(r):
            assert shard_start == at and a < b
            seen[name][a:b] += 1
            np.testing.assert_array_equal(shards[r][shard_start:shard_start + b - a],
                                          arrays[name].reshape(-1)[a:b])
            at += b - a
    assert all((count == 1).all() for count in seen.values())
    # each rank's checkpoint pieces, concatenated in rank order, are each tensor; a rank that
    # writes nothing (None) gives empty pieces of every tensor
    pieces = [layout.pieces(shards[r], r, "p/") for r in range(world_size)]
    for name, shape in shapes.items():
        parts = [p[f"p/{name}"] for p in pieces]
        assert {(axis, full) for _, axis, full in parts} == {(0, shape)}
        np.testing.assert_array_equal(np.concatenate([piece for piece, _, _ in parts]),
                                      arrays[name].reshape(-1))
    assert all(piece.size == 0 for piece, _, _ in layout.pieces(shards[0], None).values())


def test_flatten_unflatten_and_errors():
    shapes = {"a": (2, 3), "b": (5,)}
    layout = FlatLayout.from_shapes(shapes, 3)
    assert (layout.total, layout.padded, layout.shard_size) == (11, 12, 4)
    assert layout.owned(1) == [("a", 4, 6, 0), ("b", 0, 2, 2)]
    assert layout.owned(2) == [("b", 2, 5, 0)]
    arrays = {"a": np.arange(6.0).reshape(2, 3), "b": np.arange(5.0)}
    back = layout.unflatten(layout.flatten(arrays))
    np.testing.assert_array_equal(back["a"], arrays["a"])
    with pytest.raises(ToolkitError, match="world size 0"):
        FlatLayout.from_shapes(shapes, 0)
    with pytest.raises(ToolkitError, match="rank 3"):
        layout.owned(3)
    with pytest.raises(ToolkitError, match="gather needs 3 shards"):
        layout.gather([np.zeros(4)] * 2)
    with pytest.raises(ToolkitError, match="shape"):
        layout.flatten({"a": np.zeros((3, 2)), "b": np.zeros(5)})
    with pytest.raises(ToolkitError, match="lack"):
        layout.shard({"a": np.zeros((2, 3))}, 0)


def test_units_of_gpt_mlp_and_cnn_names():
    spec = GPT(vocab=16, context=8, width=8, layers=3, heads=2, tied=False)
    units = units_of(spec.param_shapes())
    assert list(units) == ["blocks.0", "blocks.1", "blocks.2"]
    assert units["blocks.0"][:2] == ["tok_emb", "pos_emb"]
    assert units["blocks.2"][-3:] == ["ln_f.scale", "ln_f.bias", "head.kernel"]
    assert sum(map(len, units.values())) == len(spec.param_shapes())
    assert units_of(MLP((4, 5, 3)).init(0)) == {
        "layers.0": ["layers.0.kernel", "layers.0.bias"],
        "layers.1": ["layers.1.kernel", "layers.1.bias"]}
    assert list(units_of(["convs.0.kernel", "convs.0.bias", "head.kernel"])) == ["convs.0"]
    assert units_of(["w", "b"]) == {"all": ["w", "b"]}


def test_unit_layouts_round_trip_a_gpt():
    spec = GPT(vocab=16, context=8, width=8, layers=2, heads=2)
    params = spec.init(0)
    layouts = unit_layouts(spec.param_shapes(), 5)
    assert sum(layout.total for layout in layouts.values()) == spec.num_params
    for layout in layouts.values():
        part = {n: params[n] for n in layout.names}
        back = layout.gather([layout.shard(part, r) for r in range(5)])
        for name in layout.names:
            np.testing.assert_array_equal(back[name], params[name])


def test_the_data_share_of_each_process_follows_its_place_in_the_mesh():
    """Processes that compute one replica together load the same share; the others their own.
    Checked against the mesh drawn by hand: devices process-major, ``tensor_parallel``
    consecutive devices per model group."""

    def shares(layout, world, local):
        return [tuple(dataclass_values(layout.data_share(world, r, local)))
                for r in range(world)]

    def dataclass_values(share):
        assert isinstance(share, DataShare)
        return share.count, share.index

    assert shares(DataParallel(), 4, 1) == [(4, 0), (4, 1), (4, 2), (4, 3)]
    assert shares(Sharded(3), 2, 2) == [(2, 0), (2, 1)]
    # 4 processes x 1 device, model groups {0, 1} and {2, 3}
    assert shares(Sharded(3, tensor_parallel=2), 4, 1) == [(2, 0), (2, 0), (2, 1), (2, 1)]
    assert shares(Sharded(3, tensor_parallel=4), 4, 1) == [(1, 0)] * 4
    # 2 processes x 2 devices: groups of 2 inside each process; of 4 across both
    assert shares(Sharded(3, tensor_parallel=2), 2, 2) == [(2, 0), (2, 1)]
    assert shares(Sharded(1, tensor_parallel=4), 2, 2) == [(1, 0), (1, 0)]
    # 4 processes x 2 devices, groups of 4: processes {0, 1} and {2, 3}
    assert shares(Sharded(2, tensor_parallel=4), 4, 2) == [(2, 0), (2, 0), (2, 1), (2, 1)]
    # a pipeline's stages share their replica's samples: rank r is replica r // S, or, with
    # a stage's replicas on neighbouring ranks, r % D
    assert shares(Pipeline(2, 4), 4, 1) == [(2, 0), (2, 0), (2, 1), (2, 1)]
    assert shares(Pipeline(2, 4, within_node="replicas"), 4, 1) == [(2, 0), (2, 1), (2, 0),
                                                                    (2, 1)]
    assert shares(Pipeline(2, 4), 2, 1) == [(1, 0), (1, 0)]


@pytest.mark.parametrize(("layout", "world", "local", "match"), [
    (Sharded(3, tensor_parallel=2), 2, 3, r"cuts the 3 devices of a process into uneven.*"
     r"use one of \[1, 3, 6\]"),
    (Sharded(3, tensor_parallel=4), 3, 2, r"does not divide the 6 devices.*\[1, 2, 6\]"),
    (Sharded(3, tensor_parallel=3), 2, 2, r"does not divide the 4 devices.*\[1, 2, 4\]"),
    (Sharded(3, tensor_parallel=4), 2, 1, r"does not divide the 2 devices.*\[1, 2\]"),
    (Sharded(3, tensor_parallel=6), 4, 2, r"does not divide the 8 devices"),
    (Sharded(3, tensor_parallel=3), 3, 2, r"cuts the 2 devices of a process into uneven"),
])
def test_a_tensor_parallel_size_the_devices_cannot_take_is_a_clear_error(layout, world, local,
                                                                         match):
    with pytest.raises(ToolkitError, match=re.compile(match, re.S)) as err:
        layout.data_share(world, 0, local)
    assert "HINT" in str(err.value)


def test_forms_and_field_types_are_normalised():
    assert parse_layout("dp") == DataParallel() == parse_layout("data_parallel")
    sharded = Sharded(np.int64(3), tensor_parallel=np.int64(2))
    assert type(sharded.stage) is int and type(sharded.tensor_parallel) is int
    assert sharded.name == "sharded:3:tp2"
    pipeline = Pipeline(2, 4, splits=[3])  # a list of split points becomes a tuple
    assert pipeline.splits == (3,) and isinstance(pipeline.splits, tuple)
    for bad in (3, (1.5,), (True,)):
        with pytest.raises(ToolkitError, match="splits="):
            Pipeline(2, 4, splits=bad)


def test_data_shares_are_integers_and_one_device_is_the_default():
    share = Sharded(3, tensor_parallel=2).data_share(4, rank=3)
    assert share == DataShare(2, 1) and type(share.count) is int and type(share.index) is int
    assert Sharded(3, tensor_parallel=2).data_share(2, 1) == DataShare(1, 0)  # 1 device each


def test_layouts_in_words_and_their_micro_batch():
    assert DataParallel().describe(2, 2) == "data parallel over 4 device(s)"
    assert Sharded(1, 4).describe(2, 2) == "sharded:1:tp4 (ZeRO-1) over data=1 x model=4"
    assert Pipeline(4, 8, "interleaved-1f1b", chunks=2).describe(8) == (
        "pipeline of 4 stages x 2 replica(s), 8 micro-batches, interleaved-1f1b, "
        "2 chunks per stage")
    assert DataParallel().describe(3) == "data parallel over 3 device(s)"  # 1 device each
    assert Sharded(2).describe(4) == "sharded:2 (ZeRO-2) over data=4"
    assert Sharded(3, 2).describe(4) == "sharded:3:tp2 (ZeRO-3) over data=2 x model=2"
    assert Pipeline(2, 4).describe(4) == (
        "pipeline of 2 stages x 2 replica(s), 4 micro-batches, 1f1b")
    assert DataParallel().micro_batch(12, 3) == 4 and Sharded(2).micro_batch(12) == 12
    assert DataParallel().micro_batch(12) == 12 and Sharded(2).micro_batch(12, 4) == 3
    assert Pipeline(2, 6).micro_batch(12, accumulation_steps=3) == 2
    for layout in (DataParallel(), Sharded(1), Pipeline(2, 4)):
        assert type(layout.micro_batch(8, 2)) is int


def test_each_layout_says_what_a_rank_holds():
    assert [DataParallel().holds(2, r) for r in range(2)] == ["replica 0", "replica 1"]
    assert DataParallel().holds(2, 1, local_devices=2) == "replicas 2-3"
    assert Sharded(3).holds(4, 2) == "shard 2" and Sharded(2).holds(2, 1, 2) == "shards 2-3"
    assert Sharded(3, tensor_parallel=2).holds(4, 3) == "shard 1, tensor part 1"
    assert Sharded(3, tensor_parallel=2).holds(2, 1, 2) == "shard 1, tensor parts 0-1"
    assert Sharded(3, tensor_parallel=2).holds(1, 0, 4) == "shards 0-1, tensor parts 0-1"
    assert Sharded(3, tensor_parallel=4).holds(4, 2, 2) == "shard 1, tensor parts 0-1"
    assert [Pipeline(2, 4).holds(4, r) for r in range(4)] == [
        "replica 0, stage 0", "replica 0, stage 1", "replica 1, stage 0", "replica 1, stage 1"]
    assert [Pipeline(2, 4, within_node="replicas").holds(4, r) for r in range(4)] == [
        "replica 0, stage 0", "replica 1, stage 0", "replica 0, stage 1", "replica 1, stage 1"]
    # two devices per process (jax-pmap, jax-pjit): a process holds two replicas of a stage
    assert [Pipeline(2, 4).holds(4, r, 2) for r in range(4)] == [
        "replicas 0-1, stage 0", "replicas 0-1, stage 1", "replicas 2-3, stage 0",
        "replicas 2-3, stage 1"]
    assert [Pipeline(2, 4, within_node="replicas").holds(4, r, 2) for r in range(4)] == [
        "replicas 0-1, stage 0", "replicas 2-3, stage 0", "replicas 0-1, stage 1",
        "replicas 2-3, stage 1"]


class _Plain:  # a backend with data parallelism only (toolkit.Adapter's methods)
    name = "plain"

    def setup(self, env, layout=None): ...
    def build(self, model, optimizer, loss, **kw): ...
    def train_step(self, x, y, lr): ...
    def evaluate(self, x, y): ...
    def allreduce(self, values, op="mean"): ...
    def broadcast(self, values, root=0): ...
    def barrier(self): ...
    def sync_state(self): ...
    def state_dict(self): ...
    def load_state_dict(self, state): ...
    def shutdown(self): ...


class _Able(_Plain):  # ... with sharded and pipeline layouts too
    name = "able"
    layouts = ("data_parallel", "sharded", "pipeline")

    def sharded_state(self): ...
    def memory_bytes(self): ...
    def pipeline_position(self): ...


def test_resolve_layout_reads_forms_and_refuses_what_a_backend_cannot_run():
    from toolkit.parallel.layouts import resolve_layout

    assert resolve_layout(None, _Plain()) == DataParallel()
    assert resolve_layout("sharded:2", _Able()) == Sharded(2)
    assert resolve_layout(Pipeline(2, 4), _Able()) == Pipeline(2, 4)
    with pytest.raises(ToolkitError, match="backend 'plain' cannot run layout 'sharded:2'") \
            as err:
        resolve_layout("sharded:2", _Plain())
    assert "HINT: plain runs: data_parallel; choose one of these, or a backend that runs this " \
           "layout (see the README's layouts)" in str(err.value)
    with pytest.raises(ToolkitError, match="backend 'plain' cannot run layout 'pipeline:2:4") \
            as err:
        resolve_layout("pipeline:2:4", _Plain())
    assert "HINT: plain runs: data_parallel;" in str(err.value)
    sharded_only = type("ShardedOnly", (_Plain,), {"name": "so", "layouts": ("sharded",)})()
    assert resolve_layout("sharded:1", sharded_only) == Sharded(1)
    with pytest.raises(ToolkitError, match="backend 'so' cannot run layout 'data_parallel'"):
        resolve_layout(None, sharded_only)
    with pytest.raises(ToolkitError, match="is not a parallel layout") as err:
        resolve_layout(object(), _Able())
    assert str(err.value).endswith(
        "HINT: pass toolkit.DataParallel(), toolkit.Sharded(stage=...) or a text form such as "
        "'sharded:3'")
    two = type("Two", (_Plain,), {"name": "two", "layouts": ("data_parallel", "sharded")})()
    with pytest.raises(ToolkitError) as err:
        resolve_layout("pipeline:2:4", two)
    assert str(err.value).endswith(
        "HINT: two runs: data_parallel, sharded; choose one of these, or a backend that runs "
        "this layout (see the README's layouts)")


FORMS = ("write one of: data, sharded:1|2|3[:tpN], "
         "pipeline:STAGES:MICRO_BATCHES[:gpipe|1f1b|interleaved-1f1b[:CHUNKS]]"
         "[:within-node=stages|replicas], or dimensions joined with +: "
         "pipeline:S:M+sharded:Z[:gather=micro-batch]+tensor:T+replicate:R"
         "[+place:tensor:data:pipeline:replicate]")
COMMA = "dimensions are joined with +, not a comma"
NODE_HINT = "HINT: write within-node=stages (the default) or within-node=replicas"
PIPELINE_EXAMPLE = "HINT: e.g. Pipeline(stages=4, micro_batches=8)"


@pytest.mark.parametrize("text, message", [
    ("sharded:3:x2", "layout 'sharded:3:x2': expected tpN after the stage\n"
     "HINT: e.g. sharded:3 or sharded:3:tp2"),
    ("sharded:x", f"layout 'sharded:x': stage 'x' is not an integer\nHINT: {FORMS}"),
    ("Sharded:3:tpX",
     f"layout 'Sharded:3:tpX': tensor-parallel size 'x' is not an integer\nHINT: {FORMS}"),
    ("pipeline:x:4", f"layout 'pipeline:x:4': stages 'x' is not an integer\nHINT: {FORMS}"),
    ("pipeline:2:y",
     f"layout 'pipeline:2:y': micro-batches 'y' is not an integer\nHINT: {FORMS}"),
    ("pipeline:2:4:interleaved-1f1b:z",
     f"layout 'pipeline:2:4:interleaved-1f1b:z': chunks 'z' is not an integer\nHINT: {FORMS}"),
    ("Tensor", f"unknown layout 'Tensor'\nHINT: {FORMS}"),
    ("pipeline:2:4:1f1b:within-node=stage",
     "layout 'pipeline:2:4:1f1b:within-node=stage': within-node='stage' is not a pipeline "
     f"axis\n{NODE_HINT}: a replica's stages, or a stage's replicas, on neighbouring ranks "
     "(inside a node)"),
    ("pipeline:2:4:nodes=replicas", "layout 'pipeline:2:4:nodes=replicas': unknown pipeline "
     f"option 'nodes'\n{NODE_HINT}, e.g. pipeline:2:4:1f1b:within-node=replicas"),
    ("sharded:3:within-node=replicas", "layout 'sharded:3:within-node=replicas': expected tpN "
     "after the stage\nHINT: e.g. sharded:3 or sharded:3:tp2"),
    ("pipeline:2:4:1f1b:2:3", f"unknown layout 'pipeline:2:4:1f1b:2:3'\nHINT: {FORMS}"),
    ("pipeline:2:2,sharded:1",
     f"layout 'pipeline:2:2,sharded:1': {COMMA}\nHINT: e.g. pipeline:2:2+sharded:1"),
    ("sharded:3+pipeline:2", f"unknown layout 'sharded:3+pipeline:2'\nHINT: {FORMS}"),
    ("data,sharded:3", f"layout 'data,sharded:3': {COMMA}\nHINT: e.g. data+sharded:3"),
    ("sharded:3+sharded:2", "layout 'sharded:3+sharded:2' gives zero twice ('sharded:2')\n"
     "HINT: name each dimension once, e.g. pipeline:2:4+sharded:3"),
    ("sharded:3+context:2", "layout 'sharded:3+context:2': unknown dimension 'context:2'\n"
     f"HINT: join dimensions with +: {FORMS[len('write one of: '):]}"),
    ("data+replicate:2", "replicate:2 copies sharded state, but this layout shards nothing\n"
     "HINT: write sharded:Z+replicate:R (HSDP: ZeRO-Z inside each group, R groups), or drop "
     "replicate: data parallelism already replicates"),
    ("sharded:3+place:tensor:data", "place:tensor:data is not an order of the axes tensor, "
     "data, pipeline, replicate\nHINT: name each once, innermost first, e.g. "
     "place:tensor:data:pipeline:replicate"),
    ("pipeline:2:4:within-node=replicas+sharded:1", "layout 'pipeline:2:4:within-node=replicas"
     "+sharded:1': a composed layout places its stages with place:, not within-node=\nHINT: "
     "e.g. pipeline:2:4+sharded:3+place:tensor:pipeline:data:replicate puts a replica's "
     "stages inside a node"),
])
def test_parse_layout_errors_whole(text, message):
    with pytest.raises(ToolkitError) as err:
        parse_layout(text)
    assert str(err.value) == message


@pytest.mark.parametrize("make, message", [
    (lambda: Sharded(4), "Sharded stage=4 is not a ZeRO stage\n"
     "HINT: use 1 (optimizer state), 2 (+ gradients) or 3 (+ parameters, = FSDP)"),
    (lambda: Sharded(1, tensor_parallel=0),
     "Sharded tensor_parallel=0 must be a positive integer\nHINT: e.g. Sharded(stage=3)"),
    (lambda: Pipeline(0, 4), f"Pipeline stages=0 must be a positive integer\n{PIPELINE_EXAMPLE}"),
    (lambda: Pipeline(2, -1),
     f"Pipeline micro_batches=-1 must be a positive integer\n{PIPELINE_EXAMPLE}"),
    (lambda: Pipeline(2, 4, "interleaved-1f1b", chunks=0),
     f"Pipeline chunks=0 must be a positive integer\n{PIPELINE_EXAMPLE}"),
    (lambda: Pipeline(2, 4, "zb-h1"),
     "unknown pipeline schedule 'zb-h1'\nHINT: use one of: gpipe, 1f1b, interleaved-1f1b"),
    (lambda: Pipeline(2, 4, "1f1b", chunks=2),
     "Pipeline chunks=2 needs the interleaved-1f1b schedule, not '1f1b'\n"
     "HINT: use schedule='interleaved-1f1b' or chunks=1"),
    (lambda: Pipeline(2, 4, "interleaved-1f1b", 2, splits=(1, 2)),
     "Pipeline splits=(1, 2) are not 3 increasing positive layer indices\n"
     "HINT: give the first layer of each of the 4 pieces but the first, e.g. splits=(1, 2, 3), "
     "or none to balance by size"),
    (lambda: Pipeline(2, 4, splits=3),
     "Pipeline splits=3 are not 1 increasing positive layer indices\n"
     "HINT: give the first layer of each of the 2 pieces but the first, e.g. splits=(1,), "
     "or none to balance by size"),
    (lambda: Sharded(3, tensor_parallel=4).data_share(3, 0, 2),
     "tensor_parallel=4 does not divide the 6 devices\n"
     "HINT: use one of [1, 2, 6] (3 process(es) x 2 device(s))"),
    (lambda: Sharded(3, tensor_parallel=2).data_share(2, 0, 3),
     "tensor_parallel=2 cuts the 3 devices of a process into uneven model groups\n"
     "HINT: use one of [1, 3, 6] (2 process(es) x 3 device(s)): a group lies inside one "
     "process or spans whole processes"),
])
def test_layout_errors_whole(make, message):
    with pytest.raises(ToolkitError) as err:
        make()
    assert str(err.value) == message


# ---------------------------------------------------------------- composed layouts (dimensions)
from toolkit.parallel.dims import Grid  # noqa: E402


def test_a_composed_name_parses_back_and_one_dimension_is_its_own_kind():
    for text in ("pipeline:2:4:1f1b+sharded:3", "sharded:3+replicate:2",
                 "pipeline:2:4:gpipe+sharded:1+tensor:2+replicate:2", "data+tensor:2",
                 "pipeline:2:4:1f1b+tensor:2",
                 "sharded:2+tensor:2+place:data:tensor:pipeline:replicate"):
        layout = parse_layout(text)
        assert isinstance(layout, ParallelDims) and layout.name == text
        assert parse_layout(layout.name) == layout
    # one dimension (or the sharded one with tensor inside it) is the layout of that kind,
    # with the same meaning as its own text form
    assert parse_layout("sharded:3+tensor:2") == Sharded(3, tensor_parallel=2)
    assert parse_layout("tp:2+sharded:1") == Sharded(1, tensor_parallel=2)
    assert parse_layout("data+sharded:2") == Sharded(2)
    assert parse_layout("pipeline:2:4+place:tensor:pipeline:data:replicate") == Pipeline(2, 4)
    assert parse_layout("pipeline:2:4+data") == Pipeline(2, 4, within_node="replicas")
    for layout in (DataParallel(), Sharded(2), Sharded(3, 2), Pipeline(2, 4),
                   Pipeline(4, 8, "gpipe", within_node="replicas")):
        assert layout.dims.simple() == layout, layout


def test_every_classic_layout_places_its_devices_as_its_dimensions_do():
    """The one dimension arithmetic agrees with each classic layout's own: data shares and
    what each rank holds, with one and two devices per process."""
    cases = [(Sharded(3), 4, 1), (Sharded(3, 2), 4, 1), (Sharded(2, 2), 2, 2),
             (Sharded(1, 4), 2, 2), (Pipeline(2, 4), 6, 1),
             (Pipeline(2, 4, within_node="replicas"), 6, 1)]
    for layout, world, local in cases:
        dims = layout.dims
        for rank in range(world):
            assert dims.data_share(world, rank, local) == layout.data_share(world, rank, local), \
                (layout, rank)
        if local == 1:
            for rank in range(world):
                words = set(layout.holds(world, rank).split(", "))
                assert words <= set(dims.holds(world, rank).split(", ")), (layout, rank)


def test_the_default_placement_keeps_tensor_inside_and_replicas_outermost():
    """pipeline 2 x ZeRO over 2 x tensor 2 x replicate 2 on 16 ranks of 4 per node: a tensor
    group and a stage's shard group lie inside one node, a replica's stages span two nodes,
    and only the replicas' groups cross the middle of the world."""
    dims = parse_layout("pipeline:2:2+sharded:3+tensor:2+replicate:2")
    grid = dims.grid(16)
    assert grid.axes == (("replicate", 2), ("pipeline", 2), ("data", 2), ("tensor", 2))

    def node(r):
        return r // 4

    assert all(len({node(r) for r in g}) == 1 for g in grid.groups("tensor"))
    assert all(len({node(r) for r in g}) == 1 for g in grid.groups("data"))
    assert all(len({node(r) for r in g}) == 2 for g in grid.groups("pipeline"))
    assert grid.groups("replicate")[0] == (0, 8)
    assert dims.holds(16, 13) == "replica 1, stage 1, shard 0, tensor part 1"
    # the processes of a replica's tensor group load the same share; the shards and the
    # replicas load their own (replicate x data = 4 shares)
    assert [dims.data_share(16, r).index for r in range(16)] == [0, 0, 1, 1] * 2 + [2, 2, 3, 3] * 2
    assert {dims.data_share(16, r).count for r in range(16)} == {4}
    assert dims.describe(16) == ("pipeline:2:2:1f1b+sharded:3+tensor:2+replicate:2 over "
                                 "replicas=2 x stages=2 x shards=2 x tensor=2")


def test_another_placement_moves_the_axes():
    """``place:data:tensor:...``: the shards on consecutive ranks, the tensor parts apart."""
    dims = parse_layout("sharded:2+tensor:2+place:data:tensor:pipeline:replicate")
    grid = dims.grid(4)
    assert grid.groups("data") == ((0, 1), (2, 3))
    assert grid.groups("tensor") == ((0, 2), (1, 3))
    assert [dims.data_share(4, r) for r in range(4)] == [DataShare(2, i) for i in (0, 1, 0, 1)]


def test_grid_coordinates_and_groups_are_inverse():
    grid = Grid((("replicate", 2), ("pipeline", 3), ("data", 2), ("tensor", 2)))
    for i in range(grid.size):
        assert grid.index(grid.coords(i)) == i
        for axis in grid.names:
            group = grid.group(i, axis)
            assert i in group and len(group) == grid.extent(axis)
    for axis in grid.names:
        groups = grid.groups(axis)
        assert sorted(i for g in groups for i in g) == list(range(grid.size)), axis


@pytest.mark.parametrize("text, world, local, message", [
    ("pipeline:3:3+sharded:1", 4, 1, "layout pipeline:3:3:1f1b+sharded:1: pipeline 3 does not "
     "fit the 4 devices (4 process(es) x 1)\nHINT: use pipeline one of [1, 2, 4], or launch a "
     "multiple of 3 devices"),
    ("pipeline:2:2+sharded:1+tensor:4", 4, 1, "layout pipeline:2:2:1f1b+sharded:1+tensor:4: "
     "tensor 4 does not fit the 4 devices (4 process(es) x 1) beside 2 taken by the dimensions "
     "before it\nHINT: use tensor one of [1, 2], or launch a multiple of 8 devices"),
    ("sharded:3+replicate:4", 2, 1, "layout sharded:3+replicate:4: replicate 4 does not fit the "
     "2 devices (2 process(es) x 1)\nHINT: use replicate one of [1, 2], or launch a multiple "
     "of 4 devices"),
    ("pipeline:2:2+sharded:1", 1, 4, "layout pipeline:2:2:1f1b+sharded:1: the 4 devices of a "
     "process fall on 2 stage(s) and cut tensor groups unevenly\nHINT: a process's devices "
     "must hold one stage, and whole tensor groups or a part of one: put tensor (then data) "
     "innermost in place:"),
])
def test_a_dimension_that_does_not_fit_is_named_with_the_sizes_that_would(text, world, local,
                                                                         message):
    with pytest.raises(ToolkitError) as err:
        parse_layout(text).data_share(world, 0, local)
    assert str(err.value) == message


def test_a_pipelines_zero_stage_gathers_once_per_step_unless_told_per_micro_batch():
    once = parse_layout("pipeline:2:4+sharded:3")
    each = parse_layout("pipeline:2:4+sharded:3:gather=micro-batch")
    assert (once.gather, each.gather) == ("step", "micro-batch")
    assert each.name == "pipeline:2:4:1f1b+sharded:3:gather=micro-batch"
    assert parse_layout(each.name) == each and once != each
    # the executor's grid: a stage's data-parallel ranks are its replicas, placed as place: says
    assert each.staged() == Pipeline(2, 4, within_node="replicas")
    assert parse_layout("pipeline:2:4+sharded:1+place:tensor:pipeline:data:replicate"
                        ).staged() == Pipeline(2, 4)


@pytest.mark.parametrize(("text", "message"), [
    ("sharded:3:gather=micro-batch", "gather= chooses when a pipeline's ZeRO stage gathers"),
    ("pipeline:2:4+sharded:3:gather=often", "gather='often' is not when a stage gathers"),
    ("sharded:3+replicate:2+gather", "no pipeline with ZeRO"),
])
def test_gather_is_refused_where_it_chooses_nothing(text, message):
    with pytest.raises(ToolkitError) as err:
        if text.endswith("+gather"):  # (no text form has it: the value)
            ParallelDims(zero=3, replicate=2, gather="micro-batch")
        parse_layout(text)
    assert message in str(err.value) and "HINT" in str(err.value)
