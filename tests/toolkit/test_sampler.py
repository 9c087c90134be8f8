"""The shared sampler: global minibatches are those of sequential training, at any world size."""

import numpy as np
import pytest

from toolkit import GlobalBatchSampler, ToolkitError, shard_indices


def local_batches(n, b, world, rank, **kw):
    return [x.tolist() for x in GlobalBatchSampler(n, b, world_size=world, rank=rank, **kw)]


def test_published_example_24_samples_batch_8_two_ranks():
    rank0 = local_batches(24, 8, 2, 0, shuffle=False)
    rank1 = local_batches(24, 8, 2, 1, shuffle=False)
    assert rank0[1] == [8, 10, 12, 14]
    assert rank1[1] == [9, 11, 13, 15]
    assert len(rank0) == len(rank1) == 3


@pytest.mark.parametrize("world", [1, 2, 4, 8])
@pytest.mark.parametrize("n, drop_last", [(100, True), (100, False), (97, True), (97, False)])
def test_global_batches_do_not_depend_on_world_size(world, n, drop_last):
    reference = GlobalBatchSampler(n, 16, seed=3, drop_last=drop_last)
    for epoch in range(3):
        samplers = [GlobalBatchSampler(n, 16, world_size=world, rank=r, seed=3,
                                       drop_last=drop_last) for r in range(world)]
        for s in samplers:
            s.set_epoch(epoch)
        per_rank = [list(s) for s in samplers]
        assert len({len(p) for p in per_rank}) == 1
        for step, expected in enumerate(reference.global_batch(epoch, k) for k in
                                        range(len(reference))):
            got = np.concatenate([per_rank[r][step] for r in range(world)])
            assert sorted(got.tolist()) == sorted(expected.tolist())
            assert all(len(per_rank[r][step]) == 16 // world for r in range(world))


def test_every_rank_shuffles_identically_and_epochs_differ():
    a = GlobalBatchSampler(64, 8, seed=1)
    e0, e1 = a.epoch_order(0), a.epoch_order(1)
    assert not np.array_equal(e0, e1)
    assert np.array_equal(GlobalBatchSampler(64, 8, seed=1, world_size=4, rank=3).epoch_order(0),
                          e0)
    assert not np.array_equal(GlobalBatchSampler(64, 8, seed=2).epoch_order(0), e0)


def test_an_epoch_order_is_drawn_once_shared_by_copies_and_read_only():
    import copy

    a = GlobalBatchSampler(64, 8, seed=1)
    order = a.epoch_order(0)
    twin = copy.copy(a)  # as the prefetch thread's copy
    assert twin.epoch_order(0) is order and a.epoch_order(0) is order
    with pytest.raises(ValueError, match="read-only"):
        order[0] = 1
    handed_out = next(iter(a))
    handed_out[0] = -1  # a data set may sort or change the indices it is given
    assert order[0] != -1
    later = twin.epoch_order(1)  # the copy running ahead into the next epoch
    assert not np.array_equal(later, order)
    assert np.array_equal(a.epoch_order(0), order)  # drawn again, the same
    assert np.array_equal(a.epoch_order(0), GlobalBatchSampler(64, 8, seed=1).epoch_order(0))


def test_iteration_moves_to_the_next_epoch_by_itself():
    s = GlobalBatchSampler(32, 8, seed=0)
    first = [b.tolist() for b in s]
    assert (s.epoch, s.step) == (1, 0)
    second = [b.tolist() for b in s]
    assert first != second
    assert second == [s.global_batch(1, k).tolist() for k in range(4)]


def test_taking_the_last_batch_moves_to_the_next_epoch_without_exhausting():
    s = GlobalBatchSampler(32, 8, seed=0)
    it = iter(s)
    for _ in range(4):
        next(it)
    assert (s.epoch, s.step) == (1, 0)  # a loop that stops here still ends the epoch
    assert s.state_dict()["epoch"] == 1


def test_drop_last_drops_the_remainder_and_padding_wraps_around():
    dropped = GlobalBatchSampler(10, 4, shuffle=False, drop_last=True)
    assert len(dropped) == 2 and sorted(np.concatenate(list(dropped))) == list(range(8))
    padded = GlobalBatchSampler(10, 4, shuffle=False, drop_last=False)
    batches = [b.tolist() for b in padded]
    assert batches == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]
    tiny = GlobalBatchSampler(3, 8, shuffle=False, drop_last=False)
    assert [b.tolist() for b in tiny] == [[0, 1, 2, 0, 1, 2, 0, 1]]


@pytest.mark.parametrize("resume_world", [1, 2, 4])
def test_state_round_trip_resumes_mid_epoch_on_another_world_size(resume_world):
    s = GlobalBatchSampler(100, 8, world_size=2, rank=0, seed=5)
    it = iter(s)
    for _ in range(30):  # 12 steps per epoch: ends in epoch 2, step 6
        try:
            next(it)
        except StopIteration:
            it = iter(s)
            next(it)
    state = s.state_dict()
    assert (state["epoch"], state["step"]) == (2, 6)
    resumed = [GlobalBatchSampler(100, 8, world_size=resume_world, rank=r, seed=5)
               for r in range(resume_world)]
    for r in resumed:
        r.load_state_dict(state)
    rest = [list(r) for r in resumed]
    expected = [s.global_batch(2, k) for k in range(6, 12)]
    assert len(rest[0]) == 6
    for step, batch in enumerate(expected):
        got = np.concatenate([rest[r][step] for r in range(resume_world)])
        assert sorted(got.tolist()) == sorted(batch.tolist())


def test_state_from_other_data_or_seed_is_refused():
    state = GlobalBatchSampler(100, 8, seed=5).state_dict()
    with pytest.raises(ToolkitError, match="seed=5"):
        GlobalBatchSampler(100, 8, seed=6).load_state_dict(state)
    with pytest.raises(ToolkitError, match="num_samples=100"):
        GlobalBatchSampler(90, 8, seed=5).load_state_dict(state)


def test_batch_not_divisible_by_world_size_is_a_clear_error():
    with pytest.raises(ToolkitError) as err:
        GlobalBatchSampler(100, 10, world_size=4)
    text = str(err.value)
    assert "10 is not divisible by the world size 4" in text and "such as 8 or 12" in text


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_samples=0, global_batch_size=4), "empty"),
    (dict(num_samples=10, global_batch_size=0), "must be positive"),
    (dict(num_samples=10, global_batch_size=16), "larger than the data set"),
    (dict(num_samples=10, global_batch_size=4, world_size=2, rank=2), "rank 2 is outside"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ToolkitError, match=match):
        GlobalBatchSampler(**kwargs)


def test_evaluation_shards_cover_everything_once():
    shards = [shard_indices(11, 4, r) for r in range(4)]
    assert sorted(np.concatenate(shards).tolist()) == list(range(11))
    assert [len(s) for s in shards] == [3, 3, 3, 2]


def test_the_smallest_sampler_and_a_batch_of_the_whole_data_set():
    one = GlobalBatchSampler(1, 1)
    assert len(one) == 1 and [b.tolist() for b in one] == [[0]]
    whole = GlobalBatchSampler(8, 8, shuffle=False)
    assert len(whole) == 1 and [b.tolist() for b in whole] == [list(range(8))]
    assert GlobalBatchSampler(8, 4).epoch_order(0).tolist() == \
        GlobalBatchSampler(8, 4, seed=0).epoch_order(0).tolist()  # the default seed is 0
    with pytest.raises(IndexError):
        whole.global_batch(0, len(whole))


def test_state_names_every_setting_and_each_changed_one_is_refused():
    state = GlobalBatchSampler(100, 8, seed=5).state_dict()
    assert state == {"epoch": 0, "step": 0, "num_samples": 100, "global_batch_size": 8,
                     "seed": 5, "shuffle": True, "drop_last": True}
    for key, sampler in [("global_batch_size", GlobalBatchSampler(100, 4, seed=5)),
                         ("shuffle", GlobalBatchSampler(100, 8, seed=5, shuffle=False)),
                         ("drop_last", GlobalBatchSampler(100, 8, seed=5, drop_last=False))]:
        with pytest.raises(ToolkitError, match=f"saved sampler state has {key}="):
            sampler.load_state_dict(state)


def test_allowed_changes_move_the_position_by_samples():
    saved = GlobalBatchSampler(100, 8, seed=5)
    for _ in range(5):
        next(iter(saved))
    state = saved.state_dict()
    assert state["step"] == 5
    # 5 steps of 8 samples are 10 steps of 4 (and 2 of 16, the third only partly seen)
    for batch, step in ((4, 10), (16, 2), (8, 5)):
        s = GlobalBatchSampler(100, batch, seed=6, shuffle=False)
        s.load_state_dict(state, allow_changes=True)
        assert (s.epoch, s.step) == (0, step), batch
    with pytest.raises(ToolkitError, match="num_samples=100"):  # other data: never allowed
        GlobalBatchSampler(90, 8, seed=5).load_state_dict(state, allow_changes=True)
    old = {k: v for k, v in state.items() if k != "global_batch_size"}  # an older record
    s = GlobalBatchSampler(100, 8, seed=5)
    s.load_state_dict(old)
    assert s.step == 5
    # 24 steps of 4 (96 samples) are 3 of 32, past the last whole one: the next epoch
    late = {**state, "global_batch_size": 4, "step": 24, "epoch": 2}
    big = GlobalBatchSampler(100, 32, seed=5)
    big.load_state_dict(late, allow_changes=True)
    assert (big.epoch, big.step) == (3, 0)
    big.load_state_dict({**late, "step": 23}, allow_changes=True)  # 92 samples: 2 of 32
    assert (big.epoch, big.step) == (2, 2)


RESUME_HINT = ("HINT: resume with the same data set, global batch size, seed and shuffle settings "
               "as the run that saved it (the world size may differ)")


@pytest.mark.parametrize("make, message", [
    (lambda: GlobalBatchSampler(0, 4),
     "the data set is empty (num_samples=0)\nHINT: check the data you passed to the sampler"),
    (lambda: GlobalBatchSampler(10, 0), "global batch size 0 must be positive\n"
     "HINT: pass --batch-size with a positive multiple of the world size"),
    (lambda: GlobalBatchSampler(100, 10, world_size=4),
     "global batch size 10 is not divisible by the world size 4\n"
     "HINT: use a multiple of 4, such as 8 or 12"),
    (lambda: GlobalBatchSampler(100, 3, world_size=4),
     "global batch size 3 is not divisible by the world size 4\n"
     "HINT: use a multiple of 4, such as 4 or 8"),
    (lambda: GlobalBatchSampler(10, 16), "global batch size 16 is larger than the data set "
     "(10 samples), so drop_last leaves no step\n"
     "HINT: use a batch of at most 10 samples, or drop_last=False"),
    (lambda: GlobalBatchSampler(10, 4, world_size=2, rank=2), "rank 2 is outside a world of "
     "size 2\nHINT: take rank and world size from the same LaunchEnv"),
    (lambda: GlobalBatchSampler(10, 4, world_size=2, rank=-1), "rank -1 is outside a world of "
     "size 2\nHINT: take rank and world size from the same LaunchEnv"),
    (lambda: GlobalBatchSampler(100, 8, seed=6).load_state_dict(
        GlobalBatchSampler(100, 8, seed=5).state_dict()),
     f"the saved sampler state has seed=5, this run has seed=6\n{RESUME_HINT}"),
    (lambda: GlobalBatchSampler(90, 8, seed=5).load_state_dict(
        GlobalBatchSampler(100, 8, seed=5).state_dict(), allow_changes=True),
     f"the saved sampler state has num_samples=100, this run has num_samples=90\n{RESUME_HINT}"),
])
def test_sampler_errors_whole(make, message):
    with pytest.raises(ToolkitError) as err:
        make()
    assert str(err.value) == message


def test_a_step_outside_the_epoch_names_the_step_and_the_epoch_length():
    for step in (1, -1):
        with pytest.raises(IndexError) as err:
            GlobalBatchSampler(8, 8).global_batch(0, step)
        assert str(err.value) == f"step {step} outside an epoch of 1 steps"
