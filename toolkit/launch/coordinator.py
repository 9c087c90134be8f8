"""Where JAX's coordinator runs: whether the address a launcher implies is rank 0's host, and
the port every rank agrees on.

Under horovodrun and mpirun the coordinator's address is the launcher's own host (its
rendezvous server, its URI): right whenever rank 0 runs there, which both arrange when they
are started on a node of the job. Started elsewhere (horovodrun with -H naming another host
first, mpirun on a login node outside its hostfile), rank 0 would serve JAX's coordinator on
one host while every rank waits for it on another, until JAX's start-up timeout: rank 0 can
tell at once, since the address is not one of its own.
"""

from __future__ import annotations

import errno
import socket
import threading
import time

from toolkit.errors import ToolkitError
from toolkit.launch.env import LaunchEnv

_WHERE = {
    "horovodrun": "start horovodrun on the first host of -H (rank 0's), not on another host",
    "mpirun": "start mpirun on a node of its hostfile (Open MPI then places rank 0 on that "
              "node), not on a host outside the job",
}


def is_local_address(host: str) -> bool | None:
    """True when ``host`` names an address of this machine (a socket can bind to it), False
    when it does not, None when it does not resolve here."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as sock:
            try:
                sock.bind((address[0], 0))
            except OSError as err:
                if err.errno != errno.EADDRNOTAVAIL:
                    return True  # (the address exists; binding failed for another reason)
                continue
            return True
    return False


def check_coordinator_host(env: LaunchEnv) -> None:
    """Raises, on rank 0 of a multi-process job, when the coordinator's address is not this
    host's: the other ranks would wait for a coordinator that never starts there.

    >>> check_coordinator_host(LaunchEnv(2, 0, coordinator_address="127.0.0.1"))
    """
    if env.rank != 0 or env.world_size < 2:
        return
    if is_local_address(env.coordinator_address) is False:
        raise ToolkitError(
            f"the coordinator's address {env.coordinator_address} ({env.launcher}'s choice) is "
            f"not an address of {socket.gethostname()}, where rank 0 runs: the other ranks "
            "would wait for a coordinator there that never starts",
            _WHERE.get(env.launcher, "start the launcher on the node of rank 0"),
        )


# How many ports, from the job's derived one on, rank 0 may take to answer on (another job's
# rank 0 may hold the first ones), and the step between them.
AGREE_PORTS, AGREE_STRIDE = 32, 997
AGREE_TIMEOUT_SECONDS = 300.0  # (rank 0 may start late: its node busy, its imports slow)


def meeting_ports(start: int) -> list[int]:
    """The ports rank 0 tries to answer on, in order, and the other ranks ask at: ``start``
    (derived from the job's id) and ``AGREE_PORTS - 1`` more, spread over 20000-59999.

    Example:
        >>> meeting_ports(20000)[:3], len(set(meeting_ports(59990)))
        ([20000, 20997, 21994], 32)
    """
    return [20000 + (start - 20000 + i * AGREE_STRIDE) % 40000 for i in range(AGREE_PORTS)]


def agreed_port(env: LaunchEnv, timeout: float = AGREE_TIMEOUT_SECONDS) -> int:
    """The coordinator's port, the same on every rank of the job.

    Where the launcher reserved a port or the user named one (``env.job`` is ``""``), that
    one. Else a port derived from the job's id would be shared by jobs on one node whose ids
    derive the same port (every derivation into a range of ports meets another job's), so
    rank 0 takes a free port from the operating system and answers, on the first of
    :func:`meeting_ports` it can bind, every rank that asks with this job's identity
    (``env.job``); another job's answerer says it is not theirs, and a rank asks at the next
    port. Rank 0 stops answering once every rank has its answer.
    """
    if env.world_size < 2 or not env.job:
        return env.coordinator_port
    ports = meeting_ports(env.coordinator_port)
    if env.rank == 0:
        return _answer(env, ports, timeout)
    return _ask(env, ports, timeout)


def _free_port() -> int:
    """A port no process on this host holds now (the operating system's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _answer(env: LaunchEnv, ports: list[int], timeout: float) -> int:
    chosen = _free_port()
    server = None
    for port in ports:
        candidate = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            candidate.bind(("", port))
        except OSError:
            candidate.close()
            continue
        candidate.listen(64)
        server = candidate
        break
    if server is None:
        raise ToolkitError(
            f"rank 0 found none of the ports {ports[0]}, {ports[1]}, ... free on "
            f"{socket.gethostname()} to tell the other ranks the coordinator's port",
            "name a free port with TOOLKIT_COORDINATOR_PORT, or have Slurm reserve one "
            "(srun --resv-ports=1)")
    key = env.job.encode()
    waiting = set(range(1, env.world_size))

    def serve():
        deadline = time.monotonic() + timeout
        with server:
            server.settimeout(1.0)
            while waiting and time.monotonic() < deadline:
                try:
                    conn, _ = server.accept()
                except OSError:
                    continue
                with conn:
                    conn.settimeout(5.0)
                    try:
                        asked = _read_line(conn)
                        job, _, rank = asked.rpartition(b" ")
                        if job == key:
                            conn.sendall(b"%d\n" % chosen)
                            waiting.discard(int(rank))
                        else:
                            conn.sendall(b"other\n")
                    except (OSError, ValueError):
                        continue

    threading.Thread(target=serve, name="toolkit-coordinator-port", daemon=True).start()
    return chosen


def _ask(env: LaunchEnv, ports: list[int], timeout: float) -> int:
    question = env.job.encode() + b" %d\n" % env.rank
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for port in ports:
            try:
                with socket.create_connection((env.coordinator_address, port), 2.0) as conn:
                    conn.settimeout(5.0)
                    conn.sendall(question)
                    reply = _read_line(conn)
            except OSError:
                continue
            if reply.isdigit():
                return int(reply)
        time.sleep(0.2)
    raise ToolkitError(
        f"rank {env.rank} found no answer from rank 0 on {env.coordinator_address} (ports "
        f"{ports[0]}, {ports[1]}, ...) about the coordinator's port within {timeout:.0f} s",
        "rank 0 did not start, or those ports are blocked between the nodes: name a port "
        "with TOOLKIT_COORDINATOR_PORT, or have Slurm reserve one (srun --resv-ports=1)")


def _read_line(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n") and len(data) < 512:
        chunk = conn.recv(512)
        if not chunk:
            break
        data += chunk
    return data.strip()
