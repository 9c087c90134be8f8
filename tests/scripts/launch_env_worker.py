"""Reports, from every rank, the launch environment the toolkit sees (_emit): rank, local rank,
node rank, sizes, launcher, the coordinator's address and what it resolves to, the hostname.

    srun -N 2 --ntasks-per-node 2 --mpi=pmix python tests/scripts/launch_env_worker.py
"""

import dataclasses
import socket

from _emit import emit

import toolkit


def main() -> None:
    env = toolkit.current_env()
    emit({**dataclasses.asdict(env), "hostname": socket.gethostname(),
          "coordinator_ip": socket.gethostbyname(env.coordinator_address)})


if __name__ == "__main__":
    toolkit.run(main)
