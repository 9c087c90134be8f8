"""Every rank names the same stop signal, whichever signals reached which rank."""

import numpy as np

from toolkit.trainer.preemption import StopAgreement, TrainingPreempted

NAMES = ("SIGUSR1", "SIGTERM", "SIGINT")


class Others:
    """An allreduce that adds what the other ranks noted (a vector in the agreement's order)."""

    def __init__(self, *noted):
        self.noted = noted

    def allreduce(self, values, op):
        assert op == "sum"
        order = StopAgreement(1, NAMES).names
        return values + np.asarray([float(sum(n == name for n in self.noted)) for name in order])


def test_a_rank_that_got_nothing_names_what_another_got():
    stop = StopAgreement(1, NAMES)
    assert stop.agreed(1, Others("SIGTERM"), distributed=True)
    assert stop.agreed_signal == "SIGTERM" and stop.signal is None


def test_ctrl_c_anywhere_wins_so_every_rank_exits_130():
    # rank 0 got SIGINT first; rank 1 only SIGTERM so far (a launcher's, or Slurm's)
    first, second = StopAgreement(1, NAMES), StopAgreement(1, NAMES)
    first.note("SIGINT")
    second.note("SIGTERM")
    assert first.agreed(4, Others("SIGTERM"), True) and second.agreed(4, Others("SIGINT"), True)
    assert first.agreed_signal == second.agreed_signal == "SIGINT"


def test_no_signal_no_stop_and_only_on_the_agreed_steps():
    stop = StopAgreement(5, NAMES)
    assert not stop.agreed(5, Others(), True) and stop.agreed_signal is None
    stop.note("SIGUSR1")
    assert not stop.agreed(6, Others(), True)  # not a step the ranks compare on
    assert stop.agreed(10, Others(), True) and stop.agreed_signal == "SIGUSR1"
    alone = StopAgreement(5, NAMES)
    alone.note("SIGTERM")
    assert alone.agreed(3, None, distributed=False) and alone.agreed_signal == "SIGTERM"


def test_the_message_says_where_the_signal_came_from():
    assert "stopped by SIGUSR1 on another rank after step 7;" in str(
        TrainingPreempted("SIGUSR1", 7, "ck", elsewhere=True))
    assert "stopped by SIGINT after step 7;" in str(TrainingPreempted("SIGINT", 7, "ck"))
