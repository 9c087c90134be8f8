"""The stall watch's side channel inside one process: rank 0's watch and real sockets; a rank
that stops answering is a connection that says where it is and then goes quiet."""

import json
import socket
import time

import numpy as np
import pytest

from toolkit.errors import ToolkitError
from toolkit.launch import stall


class Job:
    """Rank 0's watch and the ranks connected to it, all in this process."""

    def __init__(self, world_size: int, timeout: float):
        self.verdicts, self.exits, self.shared = [], [], {}
        self.world_size, self.timeout = world_size, timeout
        self.root = stall.StallWatch(
            0, world_size, timeout, on_verdict=lambda text, record: self.verdicts.append(
                (text, record)), exit=lambda code: self.exits.append((0, code)))
        self.root.start(self._sum, "127.0.0.1")
        self.port = int(self.shared["v"][64])

    def _sum(self, values):
        """Rank 0's part of the exchange, as the sum over every rank comes out."""
        self.shared["v"] = values.copy()
        self.shared["v"][66] = self.world_size
        return self.shared["v"]

    def rank(self, rank: int) -> stall.StallWatch:
        watch = stall.StallWatch(rank, self.world_size, self.timeout,
                                 exit=lambda code: self.exits.append((rank, code)))
        watch.start(lambda v: self.shared["v"], "127.0.0.1")
        return watch

    def quiet_rank(self, rank: int, host: str, phase: str, step: int) -> socket.socket:
        """A rank that reports once and then sends nothing (a stopped process)."""
        sock = socket.create_connection(("127.0.0.1", self.port))
        sock.sendall(json.dumps({"rank": rank, "host": host}).encode() + b"\n"
                     + json.dumps({"phase": phase, "step": step, "for": 0.0}).encode() + b"\n")
        return sock

    def wait(self, what, seconds: float = 10.0):
        start = time.monotonic()
        while not what() and time.monotonic() - start < seconds:
            time.sleep(0.05)
        return time.monotonic() - start


def test_a_rank_that_goes_quiet_is_named_with_its_node_and_step():
    job = Job(3, timeout=1.0)
    one = job.rank(1)
    quiet = job.quiet_rank(2, "node2", "step", 13)
    job.root.at("step", 13)
    one.at("step", 13)
    waited = job.wait(lambda: job.exits)
    text, record = job.verdicts[0]
    assert 0.9 < waited < 3, waited
    assert "rank 2 on node2 sent nothing for 1 s, last in step 13 (the step's collectives)" \
        in text, text
    assert f"ranks 0-1 on {socket.gethostname()} wait in step 13 (the step's collectives)" \
        in text, text
    assert record["event"] == "stalled" and record["ranks"]["2"]["host"] == "node2"
    assert (0, stall.STALLED_EXIT_CODE) in job.exits
    # Rank 0 told rank 1 to end too; it ends with the same status without a word.
    assert job.wait(lambda: (1, stall.STALLED_EXIT_CODE) in job.exits, 3) < 3
    quiet.close()


def test_a_rank_that_never_enters_the_collective_is_the_one_named():
    """Every rank alive; rank 2 hangs while loading its batch of step 7: after the timeout the
    verdict names it, not the ranks that wait for it."""
    job = Job(3, timeout=1.0)
    one, two = job.rank(1), job.rank(2)
    for w in (job.root, one):
        w.at("step", 7)
    two.at("input", 7)
    job.wait(lambda: job.verdicts)
    text = job.verdicts[0][0]
    host = socket.gethostname()
    assert f"rank 2 on {host} did not arrive: still in step 7 (loading its batch)" in text, text
    assert f"ranks 0-1 on {host} wait in step 7 (the step's collectives)" in text, text


def test_a_rank_whose_process_died_is_named_after_a_grace(monkeypatch):
    monkeypatch.setattr(stall, "GONE_GRACE_SECONDS", 1.0)
    job = Job(2, timeout=30.0)
    job.quiet_rank(1, "node2", "checkpoint", 20).close()
    job.root.at("checkpoint", 20)
    waited = job.wait(lambda: job.verdicts, 10)
    assert stall.GONE_GRACE_SECONDS - 0.5 < waited < stall.GONE_GRACE_SECONDS + 2, waited
    assert "rank 1 on node2 ended (connection closed) in step 20 (writing a checkpoint)" \
        in job.verdicts[0][0]


def test_ranks_of_one_node_whose_connections_close_a_moment_apart_are_all_named():
    """A lost node's ranks die together; the verdict, due when the first one's grace has
    passed, names each rank whose connection has closed, not only the first."""
    from toolkit.launch.stall_verdict import Rank, diagnose
    ranks = {r: Rank(r, "node1" if r < 2 else "node2") for r in range(4)}
    now = time.monotonic()
    for r in ranks.values():
        r.phase, r.step, r.heard = "step", 45, now
    ranks[3].closed, ranks[2].closed = now, now + 0.5
    ranks[0].heard = ranks[1].heard = now + 4.9  # their heartbeats go on
    assert diagnose(ranks, 20.0, now + 4.9, grace=5.0) is None
    text = diagnose(ranks, 20.0, now + 5.2, grace=5.0)
    assert "ranks 2-3 on node2 ended (connection closed) in step 45" in text, text
    assert "ranks 0-1 on node1 wait in step 45" in text, text


def test_the_other_ranks_end_when_rank_0_answers_nothing(capfd):
    """Rank 0 stopped: its port accepts (the kernel does) but nothing answers."""
    server = socket.create_server(("127.0.0.1", 0))
    watch = stall.StallWatch(1, 2, 1.0, exit=lambda code: exits.append(code))
    exits: list[int] = []
    values = np.zeros(67)
    values[64], values[66] = server.getsockname()[1], 2
    name = b"127.0.0.1"
    values[:len(name)], values[65] = list(name), len(name)
    watch.start(lambda v: values, "127.0.0.1")
    watch.at("step", 3)
    start = time.monotonic()
    while not exits and time.monotonic() - start < 5:
        time.sleep(0.05)
    assert exits == [stall.STALLED_EXIT_CODE]
    err = capfd.readouterr().err
    assert "[rank 1/2] stalled: rank 0 answered nothing for 1 s; this rank waits in step 3 " \
           "(the step's collectives)" in err, err
    server.close()


def test_a_clean_end_is_no_stall():
    """Ranks that finish say goodbye and rank 0 says done: nobody is named, nobody exits,
    and the closing takes no heartbeat's wait."""
    job = Job(3, timeout=0.5)
    ranks = [job.rank(1), job.rank(2)]
    for w in (job.root, *ranks):
        w.at("step", 4)
    start = time.monotonic()
    ranks[0].close()
    job.root.close()
    ranks[1].close()
    assert time.monotonic() - start < 1
    time.sleep(1.5)
    assert job.verdicts == [] and job.exits == []


def test_idle_ranks_are_not_stuck_but_silent_ones_are():
    job = Job(2, timeout=0.5)
    one = job.rank(1)
    for w in (job.root, one):
        w.at("idle", 9)
    time.sleep(1.5)
    assert job.verdicts == []
    one.close()
    job.root.close()


@pytest.mark.parametrize("value", [-1, "10", None, float("nan"), True])
def test_a_wrong_timeout_is_named(value):
    with pytest.raises(ToolkitError, match=r"stall_timeout=.* is not a number of seconds >= 0"):
        stall.check_timeout(value)


def test_one_process_or_a_zero_timeout_watches_nothing():
    for world, timeout in ((1, 10.0), (4, 0.0)):
        watch = stall.StallWatch(0, world, timeout)
        watch.start(lambda v: pytest.fail("no exchange"), "127.0.0.1")
        assert not watch.active


def test_a_one_process_stand_in_for_a_larger_world_watches_nothing():
    """A backend stand-in whose 'allreduce' returns this process's values (tests that play
    rank 0 or rank 3 of a world of 4 in one process): the count of ranks in the sum is 1, so
    neither rank 0 waits for ranks that never come nor another rank for a rank 0."""
    for rank in (0, 3):
        watch = stall.StallWatch(rank, 4, 1.0)
        watch.start(lambda v: v, "127.0.0.1")
        assert not watch.active


def test_an_unreachable_rank_0_is_a_clear_error():
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    values = np.zeros(67)
    values[64], values[66] = port, 2
    values[:9], values[65] = list(b"127.0.0.1"), 9
    watch = stall.StallWatch(1, 2, 5.0)
    with pytest.raises(ToolkitError, match=r"rank 1 cannot reach rank 0's stall watch") as err:
        watch.start(lambda v: values, "127.0.0.1")
    assert "--stall-timeout 0" in str(err.value)
