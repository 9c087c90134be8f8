"""Cutting models into pipeline stages, and the arithmetic of a pipeline's ranks (no framework)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from toolkit.errors import ToolkitError
from toolkit.models.gpt import GPT
from toolkit.models.specs import CNN, MLP
from toolkit.parallel.layouts import Pipeline
from toolkit.parallel.pipeline.partition import (
    PipelineGrid,
    balanced_splits,
    micro_batch_size,
    partition_layers,
    partition_model,
    tied_across_stages,
)


def _largest(costs, splits):
    bounds = (0, *splits, len(costs))
    return max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))


@pytest.mark.parametrize("seed", range(25))
def test_balanced_splits_are_a_true_min_max_partition(seed):
    rng = np.random.default_rng(seed)
    costs = [int(c) for c in rng.integers(1, 50, rng.integers(2, 10))]
    parts = int(rng.integers(1, len(costs) + 1))
    splits = balanced_splits(costs, parts)
    assert len(splits) == parts - 1 and list(splits) == sorted(set(splits))
    assert all(0 < p < len(costs) for p in splits)
    brute = min(_largest(costs, c) for c in itertools.combinations(range(1, len(costs)), parts - 1))
    assert _largest(costs, splits) == brute


def test_equal_layers_split_evenly_and_heavy_ends_get_fewer_layers():
    assert partition_layers([1] * 8, 4) == (range(0, 2), range(2, 4), range(4, 6), range(6, 8))
    assert partition_layers([1] * 7, 2) == (range(0, 4), range(4, 7))
    # A native Sequential: Linear, ReLU, Linear, ReLU, Linear; each ReLU stays with its Linear.
    assert partition_layers([10, 0, 10, 0, 10], 3) == (range(0, 2), range(2, 4), range(4, 5))
    assert partition_layers([10, 10, 10, 10, 40], 2) == (range(0, 4), range(4, 5))
    assert partition_layers([9, 1, 1, 1, 1, 1, 1, 1, 1, 9], 2) == (range(0, 5), range(5, 10))


def test_gpt_partition_keeps_embeddings_first_and_head_last():
    spec = GPT(vocab=64, context=8, width=16, layers=4, heads=2)
    shapes = spec.param_shapes()
    part = partition_model(spec, 2)
    assert [list(r) for r in part.layers] == [[0, 1], [2, 3]]
    assert part.names[0][:2] == ("tok_emb", "pos_emb")
    assert all(n.startswith("blocks.0.") or n.startswith("blocks.1.") for n in part.names[0][2:])
    assert part.names[1][-3:] == ("ln_f.scale", "ln_f.bias", "tok_emb")  # the tied head
    assert part.shared == {"tok_emb": (0, 1)}
    # Every parameter on exactly one stage, except the tied embedding on both ends.
    held = [n for names in part.names for n in names]
    assert sorted(held) == sorted([*shapes, "tok_emb"])
    sizes = {n: math.prod(s) for n, s in shapes.items()}
    assert part.costs == tuple(sum(sizes[n] for n in names) for names in part.names)
    untied = partition_model(GPT(vocab=64, context=8, width=16, layers=4, heads=2, tied=False), 2)
    assert untied.names[1][-1] == "head.kernel" and untied.shared == {}


def test_gpt_balance_moves_blocks_away_from_a_heavy_embedding():
    spec = GPT(vocab=256, context=16, width=32, layers=6, heads=2)
    part = partition_model(spec, 4)
    # tok_emb + pos_emb (8704) is worth most of a block (12704): the end stages get one block.
    assert [len(r) for r in part.layers] == [1, 2, 2, 1]
    assert max(part.costs) == 25408
    assert partition_model(spec, 2, splits=(1,)).layers == (range(0, 1), range(1, 6))


def test_mlp_and_cnn_partition_by_layer():
    part = partition_model(MLP((64, 128, 128, 10)), 2)
    assert part.layers == (range(0, 1), range(1, 3))  # 8320 | 16512 + 1290
    assert part.names == (("layers.0.kernel", "layers.0.bias"),
                          ("layers.1.kernel", "layers.1.bias", "layers.2.kernel",
                           "layers.2.bias"))
    assert part.costs == (8320, 17802)
    cnn = partition_model(CNN(image_shape=(8, 8, 1), channels=(4, 4), classes=10), 2)
    assert cnn.names[1][-2:] == ("head.kernel", "head.bias")


def test_interleaved_chunks_round_robin_over_stages():
    spec = GPT(vocab=64, context=8, width=16, layers=8, heads=2)
    part = partition_model(spec, 2, chunks=2)
    assert part.layers == (range(0, 2), range(2, 4), range(4, 6), range(6, 8))
    assert part.piece(stage=1, chunk=1) == 3
    stage1 = part.names_on(1)
    assert any(n.startswith("blocks.2.") for n in stage1)
    assert any(n.startswith("blocks.7.") for n in stage1) and "tok_emb" in stage1
    assert not any(n.startswith(("blocks.0.", "blocks.4.")) for n in stage1)


@pytest.mark.parametrize("call, words", [
    (lambda: partition_layers([1, 1, 1], 4), ["4 stages for a model of 3 layers", "at most 3"]),
    (lambda: partition_model(MLP((4, 8, 2)), 3), ["3 stages for a model of 2 layers"]),
    (lambda: partition_layers([1] * 6, 2, chunks=2),
     ["6 layers do not split into 2 stages x 2 chunks", "multiple of 4"]),
    (lambda: partition_layers([1] * 6, 2, chunks=4), ["2 stages x 4 chunks for a model of 6"]),
    (lambda: partition_layers([1] * 6, 2, splits=(6,)), ["split points [6] are out of range"]),
    (lambda: partition_layers([1] * 6, 3, splits=(4, 2)), ["not increasing at 2"]),
    (lambda: partition_layers([1] * 6, 3, splits=(2,)), ["1 split points [2] for 3 stages"]),
    (lambda: partition_layers([1] * 6, 2, splits=(0,)), ["out of range"]),
    (lambda: micro_batch_size(30, 4), ["4 micro-batches do not divide the local batch of 30",
                                       "1, 2, 3, 5"]),
    (lambda: PipelineGrid(6, 4), ["world size 6 is not a multiple of the 4 pipeline stages"]),
    (lambda: Pipeline(2, 4, splits=(3, 5)), ["splits=(3, 5) are not 1 increasing"]),
    (lambda: Pipeline(2, 4, "interleaved-1f1b", 2, splits=(2, 2, 5)), ["not 3 increasing"]),
])
def test_bad_partitions_are_clear_errors(call, words):
    with pytest.raises(ToolkitError) as err:
        call()
    for word in words:
        assert word in str(err.value)
    assert "HINT" in str(err.value)


def test_explicit_splits_pass_through():
    assert partition_layers([5, 1, 1, 1], 2, splits=(3,)) == (range(0, 3), range(3, 4))
    layout = Pipeline(2, 4, "interleaved-1f1b", 2, splits=(1, 2, 5))
    part = partition_model(GPT(vocab=64, context=8, width=16, layers=6, heads=2),
                           layout.stages, layout.chunks, layout.splits)
    assert [len(r) for r in part.layers] == [1, 1, 3, 1]


def test_micro_batches_and_grid():
    assert micro_batch_size(32, 8) == 4 and micro_batch_size(5, 5) == 1
    grid = PipelineGrid(world_size=4, stages=2)  # a replica's stages on neighbouring ranks
    assert grid.replicas == 2
    assert [(grid.stage_of(r), grid.replica_of(r)) for r in range(4)] == [
        (0, 0), (1, 0), (0, 1), (1, 1)]
    assert grid.pipeline_ranks(1) == (2, 3) and grid.stage_ranks(1) == (1, 3)
    grid = PipelineGrid(world_size=4, stages=2, within_node="replicas")
    assert [(grid.stage_of(r), grid.replica_of(r)) for r in range(4)] == [
        (0, 0), (0, 1), (1, 0), (1, 1)]
    assert grid.pipeline_ranks(1) == (1, 3) and grid.stage_ranks(1) == (2, 3)


@pytest.mark.parametrize("within", ["stages", "replicas"])
@pytest.mark.parametrize("world, stages, per_rank", [
    (4, 2, 1), (6, 3, 1), (8, 2, 2), (12, 2, 3), (8, 4, 2), (8, 1, 4), (3, 3, 1)])
def test_every_rank_has_one_place_and_a_rank_s_devices_hold_one_stage(within, world, stages,
                                                                      per_rank):
    grid = PipelineGrid(world, stages, within, per_rank)
    places = [(grid.stage_of(i), grid.replica_of(i)) for i in range(world)]
    assert sorted(places) == [(s, d) for s in range(stages) for d in range(world // stages)]
    assert all(grid.rank(s, d) == i for i, (s, d) in enumerate(places))
    for first in range(0, world, per_rank):  # a rank's devices: consecutive replicas, a stage
        run = places[first:first + per_rank]
        assert {s for s, _ in run} == {run[0][0]}
        assert [d for _, d in run] == list(range(run[0][1], run[0][1] + per_rank))
    # the devices' grid agrees with the ranks' grid: device r * L + j is a replica of rank r's
    ranks = PipelineGrid(world // per_rank, stages, within)
    for i, (s, d) in enumerate(places):
        assert (s, d // per_rank) == (ranks.stage_of(i // per_rank),
                                      ranks.replica_of(i // per_rank))
    if within == "replicas":  # stage i // D of replica i % D, whatever a rank's devices
        assert places == [(i // (world // stages), i % (world // stages)) for i in range(world)]


@pytest.mark.parametrize("world, stages, within, groups", [
    (2, 2, "stages", ()),          # D = 1: nothing to average; the ends are the whole world
    (4, 2, "stages", ((0, 2), (1, 3))),  # each stage's 2 replicas; the ends are the world
    (4, 2, "replicas", ((0, 1), (2, 3))),
    (3, 3, "stages", ((0, 2),)),   # the tied embedding's first and last stage
    (6, 3, "stages", ((0, 3), (1, 4), (2, 5), (0, 2, 3, 5))),
    (6, 3, "replicas", ((0, 1), (2, 3), (4, 5), (0, 1, 4, 5))),
    (4, 1, "stages", ()),          # one stage: its replicas are the whole world
])
def test_reduction_groups(world, stages, within, groups):
    grid = PipelineGrid(world_size=world, stages=stages, within_node=within)
    assert grid.reduction_groups() == groups
    assert grid.end_ranks() == tuple(sorted(grid.stage_ranks(0) + (
        grid.stage_ranks(stages - 1) if stages > 1 else ())))


@pytest.mark.parametrize("call, message", [
    (lambda: balanced_splits([1, 2], 0),
     "parts=0 must be a positive integer\nHINT: e.g. balanced_splits([3, 1, 1, 3], 2)"),
    (lambda: balanced_splits([1, -1], 1),
     "layer costs [1.0, -1.0] must be non-negative\nHINT: pass parameter counts"),
    (lambda: balanced_splits([1, math.nan], 1),
     "layer costs [1.0, nan] must be non-negative\nHINT: pass parameter counts"),
    (lambda: balanced_splits([1, 2], 3), "3 stages (or chunks) for a model of 2 layers\n"
     "HINT: use at most 2 stages, or a model with more layers"),
    (lambda: partition_layers([1] * 4, 0),
     "stages=0 must be a positive integer\nHINT: e.g. stages=2"),
    (lambda: partition_layers([1] * 4, 2.5),
     "stages=2.5 must be a positive integer\nHINT: e.g. stages=2"),
    (lambda: partition_layers([1] * 4, True),
     "stages=True must be a positive integer\nHINT: e.g. stages=2"),
    (lambda: partition_layers([1] * 4, 2, chunks=0),
     "chunks=0 must be a positive integer\nHINT: e.g. chunks=2"),
    (lambda: partition_layers([1] * 6, 2, chunks=2),
     "6 layers do not split into 2 stages x 2 chunks of equal size\nHINT: use a layer count "
     "that is a multiple of 4, other chunks, or explicit split points"),
    (lambda: partition_layers([1] * 6, 3, splits=(2,)),
     "1 split points [2] for 3 stages (or chunks)\n"
     "HINT: give 2 increasing layer indices between 1 and 5"),
    (lambda: partition_layers([1] * 6, 2, splits=(1.5,)),
     "split point 1.5 in [1.5] is not an integer\nHINT: give layer indices, e.g. splits=(2,)"),
    (lambda: partition_layers([1] * 6, 2, splits=(True,)),
     "split point True in [True] is not an integer\nHINT: give layer indices, e.g. splits=(2,)"),
    (lambda: partition_layers([1] * 6, 3, splits=(4, 2)),
     "split points [4, 2] are out of range or not increasing at 2 (a model of 6 layers)\n"
     "HINT: give 2 strictly increasing indices between 1 and 5"),
    (lambda: micro_batch_size(0, 2),
     "local batch=0 must be a positive integer\nHINT: e.g. a batch of 32"),
    (lambda: micro_batch_size(4, 0),
     "micro_batches=0 must be a positive integer\nHINT: e.g. micro_batches=4"),
    (lambda: micro_batch_size(30, 4),
     "4 micro-batches do not divide the local batch of 30 samples\nHINT: use a number of "
     "micro-batches that divides it (1, 2, 3, 5, 6, 10, 15, 30), or a local batch that is a "
     "multiple of 4"),
    (lambda: PipelineGrid(0, 1),
     "world size=0 must be a positive integer\nHINT: e.g. world size 4"),
    (lambda: PipelineGrid(4, 0), "stages=0 must be a positive integer\nHINT: e.g. stages=2"),
    (lambda: PipelineGrid(6, 4),
     "world size 6 is not a multiple of the 4 pipeline stages\nHINT: launch S x D ranks, e.g. "
     "4 or 8, or use a number of stages that divides the world size"),
    (lambda: PipelineGrid(4, 2, within_node="nodes"),
     "within_node='nodes' is not a pipeline axis\nHINT: use 'stages' (a replica's stages on "
     "neighbouring ranks, inside a node: the default) or 'replicas' (a stage's replicas inside "
     "a node, stages across nodes)"),
    (lambda: PipelineGrid(6, 2, per_rank=2),
     "6 devices in runs of 2 per rank do not give each of the 2 stages whole runs\nHINT: use a "
     "number of ranks that is a multiple of 2"),
])
def test_partition_errors_say_what_was_wrong_and_what_to_do(call, message):
    with pytest.raises(ToolkitError) as err:
        call()
    assert str(err.value) == message


def test_the_largest_run_is_minimal_even_where_a_more_even_cut_has_a_larger_one():
    # 1 | 5 | 2 3 has runs 1, 5, 5; the cut 1 5 | 2 | 3 has smaller squares (6, 2, 3) but a
    # larger largest run: the pipeline's slowest stage decides its speed.
    assert balanced_splits([1, 5, 2, 3], 3) == (1, 2)
    # among the cuts with the smallest largest run, the most even one: 2 | 1 1 | 9, not 2 1 | 1 | 9
    assert balanced_splits([2, 1, 1, 9], 3) == (1, 3)
    # costs are any non-negative numbers: the cut does not depend on their unit
    for costs, parts in [([1, 5, 2, 3], 3), ([2, 1, 1, 9], 3), ([3, 1, 4, 1, 5, 9, 2, 6], 4)]:
        expected = balanced_splits(costs, parts)
        assert balanced_splits([c / 10 for c in costs], parts) == expected
        assert balanced_splits([c * 1000 for c in costs], parts) == expected


def test_parameter_free_layers_still_get_non_empty_runs():
    assert balanced_splits([0, 0], 2) == (1,)
    assert balanced_splits([0, 0, 0], 2) == (2,)  # among equal cuts the latest
    assert partition_layers([0, 0, 0, 0], 4) == (range(0, 1), range(1, 2), range(2, 3),
                                                 range(3, 4))


def test_micro_batch_size_is_an_int_and_piece_defaults_to_chunk_0():
    assert type(micro_batch_size(32, 8)) is int
    part = partition_model(MLP((4, 8, 8, 2)), 3)
    assert part.piece(1) == part.piece(1, chunk=0) == 1


def test_a_tied_gpt_on_one_stage_holds_its_embedding_once():
    part = partition_model(GPT(vocab=64, context=8, width=16, layers=2, heads=2), 1)
    assert part.names[0].count("tok_emb") == 1 and part.shared == {}


class _MLPWithoutArrays(MLP):
    def init(self, seed, dtype="float32"):
        raise AssertionError("partition_model drew the model's arrays")


class _GPTWithoutArrays(GPT):
    def init(self, seed, dtype="float32"):
        raise AssertionError("partition_model drew the model's arrays")


def test_partition_model_reads_shapes_without_drawing_arrays():
    """Cutting a large model must not allocate it: shapes come from the spec."""
    mlp = partition_model(_MLPWithoutArrays((64, 128, 128, 10)), 2)
    assert mlp.layers == partition_model(MLP((64, 128, 128, 10)), 2).layers
    gpt = partition_model(_GPTWithoutArrays(vocab=64, context=8, width=16, layers=4, heads=2), 2)
    assert gpt.names == partition_model(GPT(vocab=64, context=8, width=16, layers=4, heads=2),
                                        2).names


def test_a_parameter_on_the_end_stages_is_tied_one_on_a_middle_stage_is_refused_by_name():
    """The end stages keep a shared parameter's copies equal (their gradients summed); a
    parameter a middle stage shares would train apart, so the layout is refused naming it."""
    assert tied_across_stages([("emb", "h0"), ("h1",), ("emb", "out")]) == ("emb",)
    assert tied_across_stages([("emb", "emb", "h0"), ("h1",)]) == ()  # one stage's chunks
    assert tied_across_stages([("a",), ("a", "b")]) == ("a",)  # S = 2: both are ends
    with pytest.raises(ToolkitError) as err:
        tied_across_stages([("emb", "h0"), ("emb", "h1"), ("mid", "out"), ("mid", "emb")],
                           "pipeline:4:4")
    text = str(err.value)
    assert "pipeline:4:4" in text and "emb on stages 0, 1, 3" in text
    assert "mid on stages 2, 3" in text and "untie" in text
