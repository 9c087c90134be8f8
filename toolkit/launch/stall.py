"""Stalls: a rank that stops answering ends the job with a diagnosis, never a silent hang.

A rank stopped (SIGSTOP, a debugger, a swapped-out node), hung in a collective the others
never enter, killed with its node, or cut off by a failed link leaves the other ranks waiting
in the framework's collectives, and no framework says why for all four backends (Horovod's
stall inspector watches its own collectives, torch's flight recorder NCCL's, JAX nothing).
:class:`StallWatch` is one answer beside the frameworks, on a TCP side channel: every rank's
thread tells rank 0 every second what its training loop is doing (the phase and the step) and
rank 0 answers. Rank 0 ends the job when a rank has sent nothing for ``timeout`` seconds,
when a rank's connection closed while it trained (its process or node died) or when a rank
has been in one phase for ``timeout`` seconds; its message names the ranks that did not
arrive, their nodes, the step, and what the others were waiting in. A rank that hears
nothing from rank 0 for ``timeout`` seconds says so itself and ends. Every rank ends with
status 124 (``STALLED_EXIT_CODE``, what ``timeout(1)`` reports); the launcher then removes the
rank that did not arrive.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import selectors
import socket
import sys
import threading
import time
from collections.abc import Callable

from toolkit.launch.stall_verdict import PHASES, Rank, diagnose

STALLED_EXIT_CODE = 124
DEFAULT_STALL_TIMEOUT = 600.0  # seconds: a first step that compiles for minutes still passes
GONE_GRACE_SECONDS = 5.0  # a rank that failed says why and its launcher ends the job first
# A rank's phase changes reach rank 0 at most every _QUICK seconds, and rank 0 reads at most
# _MESSAGES_PER_SECOND from all ranks together (a large job's ranks report less often).
_QUICK = 0.05
_MESSAGES_PER_SECOND = 2000

def check_timeout(value) -> float:
    """``value`` as seconds, or a ToolkitError naming it."""
    from toolkit.errors import ToolkitError

    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ToolkitError(f"stall_timeout={value!r} is not a number of seconds >= 0",
                           f"the default is {DEFAULT_STALL_TIMEOUT:g} s; 0 turns the watch off")
    return float(value)


class StallWatch:
    """The side channel of one rank (see the module's text).

    Args:
        rank, world_size: this process's place in the job.
        timeout: seconds of silence, or of one phase, that end the job; 0 watches nothing.
        exchange: ``exchange(values: np.ndarray) -> np.ndarray``, a sum over ranks (the
            adapter's allreduce) that carries rank 0's host name and port to the others.
        coordinator: rank 0's address as the launcher names it, tried after its host name.
        on_verdict: ``on_verdict(text, record)`` on rank 0 before the job ends (prints and
            logs); ``exit``: how a rank ends (``os._exit`` after flushing, by default).
    """

    def __init__(self, rank: int, world_size: int, timeout: float, *,
                 on_verdict: Callable[[str, dict], None] | None = None,
                 exit: Callable[[int], None] | None = None):
        self.rank, self.world_size, self.timeout = rank, world_size, float(timeout)
        self.on_verdict = on_verdict or (lambda text, record: None)
        self._exit = exit or _exit
        self.host = socket.gethostname()
        self._state = ("start", 0, time.monotonic())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None  # a rank's connection to rank 0
        self._wake = socket.socketpair()  # wakes rank 0's loop at close
        self._lock = threading.Lock()  # one writer on the connection at a time
        self._changed = threading.Event()  # a new phase to send now

    @property
    def active(self) -> bool:
        return self._thread is not None

    def at(self, phase: str, step: int) -> None:
        """The training loop is now in ``phase`` of ``step`` (cheap: the thread sends it)."""
        if phase != self._state[0] or step != self._state[1]:
            self._state = (phase, step, time.monotonic())
            self._changed.set()

    @contextlib.contextmanager
    def during(self, phase: str, step: int):
        """``phase`` for the block, then the phase before it again (its clock restarted)."""
        before = self._state
        self.at(phase, step)
        try:
            yield
        finally:
            self.at(*before[:2])
            self._state = (*before[:2], time.monotonic())

    def _report(self) -> dict:
        phase, step, since = self._state
        return {"phase": phase, "step": step, "for": time.monotonic() - since}

    # ------------------------------------------------------------------ start and stop
    def start(self, exchange, coordinator: str) -> None:
        """Opens rank 0's port (any free one) and connects every other rank to it; every rank
        calls it at the same point (``exchange`` is a collective)."""
        import numpy as np

        if self.timeout <= 0 or self.world_size == 1:
            return
        values = np.zeros(67)
        values[66] = 1  # every rank counts itself
        if self.rank == 0:
            server = socket.create_server(("", 0), backlog=self.world_size)
            name = self.host.encode()[:64]
            values[:len(name)] = list(name)
            values[64] = server.getsockname()[1]
            values[65] = len(name)
        values = np.asarray(exchange(values))
        host = bytes(int(v) for v in values[:int(values[65])]).decode()
        port = int(values[64])
        # Nothing to watch when rank 0's stall_timeout is 0, or when the sum did not add every
        # rank (a one-process stand-in for a backend, playing one rank of a larger world).
        if port == 0 or int(values[66]) != self.world_size:
            if self.rank == 0:
                server.close()
            return
        if self.rank == 0:
            target, args = self._serve, (server,)
        else:
            self._sock = self._connect(host, coordinator, port)
            target, args = self._heartbeat, (self._sock,)
        self._thread = threading.Thread(target=target, args=args, name="toolkit-stall-watch",
                                        daemon=True)
        self._thread.start()

    def _connect(self, host: str, coordinator: str, port: int) -> socket.socket:
        from toolkit.errors import ToolkitError

        errors = []
        for address in dict.fromkeys((host, coordinator)):
            try:
                sock = socket.create_connection((address, port), timeout=30)
            except OSError as err:
                errors.append(f"{address}:{port}: {err}")
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(_line({"rank": self.rank, "host": self.host}))
            return sock
        raise ToolkitError(
            f"rank {self.rank} cannot reach rank 0's stall watch ({'; '.join(errors)})",
            "let the ranks reach rank 0's node on TCP ports, or turn the watch off with "
            "--stall-timeout 0 (stall_timeout=0)")

    def close(self) -> None:
        """Stops watching (the end of training, or of the process): rank 0 tells the others
        "done", the others say goodbye; neither waits for the other."""
        self.at("idle", self._state[1])
        if self._thread is None:
            return
        self._stop.set()
        if self._sock is not None:
            try:
                with self._lock:
                    self._sock.sendall(_line({"bye": True}))
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._wake[0].send(b"x")
        self._thread.join(5)
        self._thread = None

    # ------------------------------------------------------------------ the other ranks
    def _heartbeat(self, sock: socket.socket) -> None:
        interval = min(1.0, self.timeout / 10)
        heard, buffer = time.monotonic(), b""
        sock.settimeout(max(_QUICK, self.world_size / _MESSAGES_PER_SECOND))
        try:
            while not self._stop.is_set():
                self._changed.clear()
                with self._lock:
                    sock.sendall(_line(self._report()))
                deadline = time.monotonic() + interval
                # (a new phase goes out at once, but not more often than the socket's timeout)
                while time.monotonic() < deadline and not self._changed.is_set():
                    try:
                        data = sock.recv(4096)
                    except TimeoutError:
                        break
                    if not data and self._stop.is_set():
                        return None
                    if not data:  # rank 0 ended without a verdict: its launcher says why
                        time.sleep(GONE_GRACE_SECONDS)
                        return self._silent_rank0("ended")
                    heard, buffer = time.monotonic(), buffer + data
                    *messages, buffer = buffer.split(b"\n")
                    if b"abort" in messages:
                        return self._exit(STALLED_EXIT_CODE)  # rank 0 says why
                    if b"done" in messages:
                        return None
                if time.monotonic() - heard > self.timeout:
                    return self._silent_rank0(f"answered nothing for {self.timeout:.0f} s")
        except OSError:
            if not self._stop.is_set():
                time.sleep(GONE_GRACE_SECONDS)
                self._silent_rank0("ended")
        finally:
            sock.close()

    def _silent_rank0(self, how: str) -> None:
        report = self._report()
        where = PHASES[report["phase"]] if report["phase"] in ("start", "idle") else \
            f"step {report['step']} ({PHASES[report['phase']]})"
        print(f"[rank {self.rank}/{self.world_size}] stalled: rank 0 {how}; this rank waits in "
              f"{where}. The job ends (stall timeout {self.timeout:g} s): a stopped or hung "
              "process, a lost node or a cut link; resume with --resume latest",
              file=sys.stderr, flush=True)
        self._exit(STALLED_EXIT_CODE)

    # ------------------------------------------------------------------ rank 0
    def _serve(self, server: socket.socket) -> None:
        ranks = {0: Rank(0, self.host)}
        started = time.monotonic()
        sel = selectors.DefaultSelector()
        sel.register(server, selectors.EVENT_READ)
        sel.register(self._wake[1], selectors.EVENT_READ)
        peers: dict[socket.socket, list] = {}  # socket -> [rank or None, buffer]
        interval = min(1.0, self.timeout / 10)
        while not self._stop.is_set():
            for key, _ in sel.select(interval / 4):
                if key.fileobj is self._wake[1]:
                    continue
                if key.fileobj is server:
                    conn, _ = server.accept()
                    conn.setblocking(False)
                    sel.register(conn, selectors.EVENT_READ)
                    peers[conn] = [None, b""]
                    continue
                conn = key.fileobj
                self._receive(conn, peers, ranks, sel)
            now = time.monotonic()
            mine, me = self._report(), ranks[0]
            me.phase, me.step, me.seconds_in_phase, me.heard = (
                mine["phase"], mine["step"], mine["for"], now)
            for rank in range(1, self.world_size):  # a rank that never connected is silent
                if rank not in ranks and now - started > self.timeout:
                    ranks[rank] = Rank(rank, "its node (it never connected)")
                    ranks[rank].heard = started
            verdict = diagnose(ranks, self.timeout, now, interval, GONE_GRACE_SECONDS)
            if verdict is not None:
                return self._end(verdict, ranks, peers)
        for conn in peers:
            try:
                conn.setblocking(True)
                conn.sendall(b"done\n")
            except OSError:
                pass
        server.close()

    def _receive(self, conn, peers, ranks, sel) -> None:
        entry = peers[conn]
        try:
            data = conn.recv(4096)
        except OSError:
            data = b""
        if not data:
            sel.unregister(conn)
            conn.close()
            del peers[conn]
            if entry[0] is not None and not ranks[entry[0]].done:
                ranks[entry[0]].closed = time.monotonic()
            return
        *lines, entry[1] = (entry[1] + data).split(b"\n")
        for raw in lines:
            message = json.loads(raw)
            if "host" in message:
                entry[0] = message["rank"]
                ranks[entry[0]] = Rank(entry[0], message["host"])
                continue
            rank = ranks[entry[0]]
            rank.heard = time.monotonic()
            if message.get("bye"):
                rank.done = True
                continue
            rank.phase, rank.step, rank.seconds_in_phase = (
                message["phase"], message["step"], message["for"])
        try:
            conn.send(b"ok\n")
        except OSError:
            pass

    def _end(self, verdict: str, ranks: dict[int, Rank], peers) -> None:
        text = (f"stalled (stall timeout {self.timeout:g} s):\n  {verdict}\n"
                "The job ends: a stopped or hung process, a lost node or a cut link on the "
                "ranks named first. Resume from the last checkpoint with --resume latest; "
                "--stall-timeout sets the wait.")
        record = {"event": "stalled", "timeout": self.timeout, "ranks": {
            str(r.rank): {"host": r.host, "phase": r.phase, "step": r.step,
                          "silent_s": round(time.monotonic() - r.heard, 1),
                          "ended": r.closed is not None} for r in ranks.values()}}
        for conn in peers:
            try:
                conn.send(b"abort\n")
            except OSError:
                pass
        self.on_verdict(text, record)
        self._exit(STALLED_EXIT_CODE)


# The process's watch: one at a time (a new Trainer's replaces the last one's), closed in order
# when the process ends normally.
_current: StallWatch | None = None


def open_watch(env, timeout: float, exchange, log: Callable[[dict], None]) -> StallWatch:
    """Closes the process's previous watch and starts one for ``env`` (a :class:`LaunchEnv`);
    a collective: every rank calls it at the same point. Rank 0's verdict goes to its stderr
    and, as a record, to ``log``."""
    global _current
    if _current is not None:
        _current.close()

    def say(text: str, record: dict) -> None:
        print(text, file=sys.stderr, flush=True)
        log(record)

    _current = StallWatch(env.rank, env.world_size, timeout, on_verdict=say)
    _current.start(exchange, env.coordinator_address)
    return _current


@atexit.register
def _close_at_exit() -> None:
    if _current is not None:
        _current.close()


def _line(message: dict) -> bytes:
    return json.dumps(message).encode() + b"\n"


def _exit(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
