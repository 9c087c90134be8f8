"""Whether the coordinator address a launcher implies is rank 0's host.

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
