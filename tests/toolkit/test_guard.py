"""The divergence guard's rules, without a framework (tests/test_divergence.py runs it in jobs)."""

import math

import pytest

from toolkit import DIVERGED_EXIT_CODE, ToolkitError, TrainingDiverged
from toolkit.trainer.guard import DivergenceGuard


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_loss_is_found_at_its_step(bad):
    guard = DivergenceGuard()
    assert guard.check(0, [2.3, 2.2]) is None
    step, loss, why = guard.check(2, [2.1, bad, 2.0])
    assert step == 4 and why == "is not finite"
    assert math.isnan(loss) if math.isnan(bad) else loss == bad


def test_a_nan_is_named_with_its_step_and_value():
    step, loss, why = DivergenceGuard().check(10, [1.0, math.nan])
    assert step == 12 and math.isnan(loss) and why == "is not finite"


def test_a_non_finite_gradient_norm_stops_a_finite_loss():
    guard = DivergenceGuard()
    assert guard.check(0, [2.0, 2.0], [1.0, 3.0]) is None
    assert guard.check(2, [2.0, 1e27, 2.0], [1.0, math.inf, 1.0]) == (
        4, 1e27, "is finite but the gradient norm inf is not")
    assert guard.check(5, [2.0], []) is None  # a backend that reports no norms


def test_without_a_factor_any_finite_loss_passes():
    guard = DivergenceGuard()
    assert guard.check(0, [1.0, 1e30, 1e35, 1e38]) is None


def test_a_loss_above_factor_times_its_best_for_window_steps_stops_at_the_last_of_them():
    guard = DivergenceGuard(factor=4, window=3)
    assert guard.check(0, [2.0, 1.0, 3.9, 4.1, 5.0]) is None  # 4.0 is not above 4 x 1.0
    assert guard.above == 2
    step, loss, why = guard.check(5, [9.0, 1.0])
    assert (step, loss) == (6, 9.0)
    assert why == "stayed above 4 x its best (1) for 3 steps"


def test_a_loss_that_comes_back_resets_the_count():
    guard = DivergenceGuard(factor=2, window=3)
    assert guard.check(0, [1.0, 2.5, 2.5, 1.5, 2.5, 2.5]) is None
    assert guard.above == 2
    assert guard.check(6, [1.9]) is None and guard.above == 0
    assert guard.check(7, [2.1, 2.1, 2.1])[0] == 10


def test_the_best_follows_the_lowest_loss_so_far():
    guard = DivergenceGuard(factor=10, window=1)
    assert guard.check(0, [5.0, 40.0, 0.5]) is None and guard.best == 0.5
    assert guard.check(3, [5.1])[:2] == (4, 5.1)


def test_a_loss_at_or_below_zero_has_no_factor_rule():
    guard = DivergenceGuard(factor=2, window=1)
    assert guard.check(0, [-1.0, 5.0, 100.0]) is None
    assert guard.check(3, [math.nan])[0] == 4  # non-finite still stops


@pytest.mark.parametrize("factor", [1, 0.5, -3, math.inf, math.nan, "10", True])
def test_a_factor_that_is_not_a_number_above_one_is_refused(factor):
    with pytest.raises(ToolkitError, match=r"divergence_factor=.* is not a number above 1") as e:
        DivergenceGuard(factor=factor)
    assert "or None to stop on non-finite losses only" in e.value.hint


@pytest.mark.parametrize("window", [0, -1, 2.5, "3", True])
def test_a_window_that_is_not_a_whole_number_is_refused(window):
    with pytest.raises(ToolkitError, match=r"divergence_window=.* is not a whole number >= 1"):
        DivergenceGuard(factor=3, window=window)


def test_the_error_names_the_step_the_value_and_the_last_good_checkpoint(tmp_path):
    err = TrainingDiverged(7, math.nan, "is not finite", tmp_path / "step_000000006")
    assert isinstance(err, ToolkitError) and DIVERGED_EXIT_CODE == 3
    assert str(err).startswith(
        f"training diverged at step 7: the loss nan is not finite; stopped with nothing saved "
        f"from that state (the last good checkpoint is {tmp_path / 'step_000000006'})")
    assert err.step == 7 and err.checkpoint == tmp_path / "step_000000006"
    none = TrainingDiverged(3, 1e9, "stayed above 10 x its best (2) for 5 steps", None)
    assert "(no checkpoint was written before it)" in str(none)
    assert "smaller learning rate" in none.hint


def test_skipped_steps_pass_until_more_than_the_limit_in_a_row():
    guard = DivergenceGuard(max_consecutive_skips=2)
    nan = math.nan
    # two skipped in a row, then a good step resets the count; their NaN losses do not stop
    assert guard.check(0, [2.0, nan, nan, 1.9], [1.0, nan, nan, 1.0],
                       [False, True, True, False]) is None
    assert guard.check(4, [nan, nan], [nan, nan], [True, True]) is None
    step, loss, why = guard.check(6, [nan, 1.8], [nan, 1.0], [True, False])
    assert step == 7 and math.isnan(loss)
    assert why == ("is not finite, and 3 consecutive steps were skipped "
                   "(max_consecutive_skips=2)")


def test_a_non_finite_loss_that_was_not_skipped_still_stops():
    """A skipped step is one whose gradient norm was not finite; an infinite loss with a finite
    gradient was applied, and stops the run as without skipping."""
    guard = DivergenceGuard(max_consecutive_skips=5)
    assert guard.check(0, [2.0, math.inf], [1.0, 1.0], [False, False]) == (
        2, math.inf, "is not finite")


def test_no_skip_allowed_stops_at_the_first_skipped_step():
    assert DivergenceGuard(max_consecutive_skips=0).check(3, [math.nan], [math.nan], [True]) \
        == (4, pytest.approx(math.nan, nan_ok=True), "is not finite, and a step was skipped "
            "(max_consecutive_skips=0)")


@pytest.mark.parametrize("limit", [-1, 1.5, True, "3"])
def test_a_skip_limit_that_is_not_a_whole_number_is_refused(limit):
    with pytest.raises(ToolkitError) as err:
        DivergenceGuard(max_consecutive_skips=limit)
    assert str(err.value) == (f"max_consecutive_skips={limit!r} is not a whole number >= 0\n"
                              "HINT: use e.g. 5: more consecutive skipped steps stop the run")


def test_the_guards_state_goes_through_a_checkpoint():
    guard = DivergenceGuard(factor=4, window=3, max_consecutive_skips=2)
    guard.check(0, [1.0, 5.0, 4.5, math.nan], [1.0, 1.0, 1.0, math.nan],
                [False, False, False, True])
    state = guard.state_dict()
    assert state == {"best": 1.0, "above": 2, "skips": 1}
    resumed = DivergenceGuard(factor=4, window=3, max_consecutive_skips=2)
    resumed.load_state_dict(state)
    # the next step above 4 x 1.0 is the third in a row, as without the interruption
    assert resumed.check(4, [6.0]) == guard.check(4, [6.0]) == (
        5, 6.0, "stayed above 4 x its best (1) for 3 steps")
    fresh = DivergenceGuard()
    fresh.load_state_dict(None)  # a checkpoint written before the guard was recorded
    assert fresh.state_dict() == {"best": None, "above": 0, "skips": 0}


def test_a_resumed_run_stops_where_the_uninterrupted_one_does(tmp_path):
    """A loss climbing under a negative learning rate: the resumed Trainer's guard carries
    the best loss and the run above it, so it stops at the same step."""
    import adapters
    import toolkit
    from toolkit.datasets import load_digits

    (x, y), _ = load_digits()

    def trainer(steps, **kw):
        return toolkit.Trainer(adapters.get("jax-pjit"), toolkit.MLP((64, 16, 10)),
                               toolkit.SGD(lr=-0.3), global_batch_size=32, max_steps=steps,
                               progress=False, divergence_factor=1.5, divergence_window=4,
                               checkpoint_dir=tmp_path / "ckpt", **kw)

    with pytest.raises(TrainingDiverged) as whole:
        trainer(60, checkpoint_every=100).fit(x, y)
    stop = whole.value.step
    assert stop > 6
    assert not (tmp_path / "ckpt").exists()  # nothing was saved from it
    # the same run cut short two steps before the stop (checkpointed), then resumed
    trainer(stop - 2, checkpoint_every=100).fit(x, y)
    with pytest.raises(TrainingDiverged) as resumed:
        trainer(60, resume="latest", checkpoint_every=100).fit(x, y)
    assert resumed.value.step == stop
