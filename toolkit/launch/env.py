"""The launch environment: who am I, how many are we, where is the coordinator.

Resolved once from the variables a launcher sets, never at import time, and never by writing
``os.environ``. Detection order: horovodrun (gloo; under ``--mpi`` it looks like mpirun), a Slurm
step started by ``srun``, Open MPI's ``mpirun``, torchrun-style ``RANK``/``WORLD_SIZE``, else a
single process.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping

from toolkit.errors import ToolkitError

# Ports for JAX's coordinator: the one Slurm reserved for the step (--resv-ports=1), the one
# TOOLKIT_COORDINATOR_PORT names, or one that rank 0 takes when the job starts and tells the
# other ranks (toolkit.launch.coordinator.agreed_port), found from a port derived from the
# job's id: jobs on one node whose derived ports meet still get different ones.
_PORT_BASE = 20000
PORT_VARIABLE = "TOOLKIT_COORDINATOR_PORT"


@dataclasses.dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job. Frozen: resolve it once with :func:`detect_launch_env`.

    Attributes:
        world_size: number of processes in the job (the WORLD communicator's size).
        rank: this process's global rank, ``0 <= rank < world_size``.
        local_rank: rank among the processes on this node.
        local_size: number of processes on this node.
        node_rank: index of this node among the job's nodes.
        coordinator_address: host of rank 0 (for JAX's distributed runtime).
        coordinator_port: a port on that host that is free to use for this job.
        launcher: which launcher started the job: ``horovodrun``, ``srun``, ``mpirun``,
            ``torchrun`` or ``python``.
        num_nodes: the job's nodes (0 where the launcher does not say: an mpirun without Open
            MPI 4's runtime variables).
        job: the job's identity as its launcher gives it (Slurm's job and step ids, Open MPI's
            job id) when ``coordinator_port`` is only where the ranks meet to agree on the
            coordinator's port (:func:`toolkit.launch.coordinator.agreed_port`); ``""`` when
            it is the port itself (reserved by Slurm, named by the user, horovodrun's).
    """

    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    local_size: int = 1
    node_rank: int = 0
    coordinator_address: str = "127.0.0.1"
    coordinator_port: int = _PORT_BASE
    launcher: str = "python"
    num_nodes: int = 1
    job: str = dataclasses.field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ToolkitError(
                f"inconsistent launch environment: rank={self.rank}, world_size={self.world_size} "
                f"(launcher {self.launcher})",
                "the launcher's rank/size variables disagree; relaunch the job instead of "
                "setting them by hand",
            )
        if not 0 <= self.local_rank < self.local_size:
            raise ToolkitError(
                f"inconsistent launch environment: local_rank={self.local_rank}, "
                f"local_size={self.local_size} (launcher {self.launcher})",
                "relaunch the job instead of setting rank variables by hand",
            )

    @property
    def is_distributed(self) -> bool:
        """True when more than one process takes part."""
        return self.world_size > 1

    @property
    def coordinator(self) -> str:
        """``host:port`` of the coordinator, as ``jax.distributed.initialize`` wants it."""
        return f"{self.coordinator_address}:{self.coordinator_port}"


def expand_nodelist(nodelist: str) -> list[str]:
    """Expands a Slurm hostlist expression into host names, in order.

    >>> expand_nodelist("node[01-03],gpu7")
    ['node01', 'node02', 'node03', 'gpu7']
    >>> expand_nodelist("a1,b[2-3,5]")
    ['a1', 'b2', 'b3', 'b5']
    """
    hosts: list[str] = []
    for item in _split_top_level(nodelist.strip()):
        hosts.extend(_expand_one(item))
    if not hosts:
        raise ToolkitError(
            f"cannot read the Slurm nodelist {nodelist!r}",
            "expected a hostlist such as 'node[01-04]' or 'a1,b[2-3]'",
        )
    return hosts


def _split_top_level(text: str) -> list[str]:
    """Splits on commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p]


def _expand_one(item: str) -> list[str]:
    match = re.match(r"^([^\[]*)\[([^\]]+)\](.*)$", item)
    if match is None:
        if "[" in item or "]" in item:
            raise ToolkitError(f"cannot read the Slurm nodelist item {item!r}",
                               "expected a hostlist such as 'node[01-04]'")
        return [item]
    prefix, ranges, rest = match.groups()
    out = []
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ToolkitError(f"cannot read the range {part!r} in Slurm nodelist item {item!r}",
                               "expected numeric ranges such as 'node[01-04,07]'")
        width = len(lo)
        for n in range(int(lo), int(hi or lo) + 1):
            # The rest may hold another bracket group ("rack[1-2]-node[1-2]").
            out.extend(prefix + str(n).zfill(width) + tail for tail in _expand_one(rest or ""))
    return out


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = environ.get(name)
    if value is None:
        if default is None:
            raise ToolkitError(f"the launcher set no {name}",
                               "relaunch the job with an unmodified launcher environment")
        return default
    try:
        return int(value)
    except ValueError:
        raise ToolkitError(f"{name}={value!r} is not an integer",
                           "relaunch the job instead of setting rank variables by hand") from None


def _port_for(job_id: str, step_id: str = "0") -> int:
    """A port from a job id and step id: concurrent jobs and steps get different ones."""
    job = int(re.sub(r"\D", "", job_id) or 0)
    step = int(re.sub(r"\D", "", step_id) or 0)
    return _PORT_BASE + (job % 1000) * 20 + step % 20


def _from_horovodrun(env: Mapping[str, str]) -> LaunchEnv:
    addr = env.get("HOROVOD_GLOO_RENDEZVOUS_ADDR", "127.0.0.1")
    rdv_port = _int(env, "HOROVOD_GLOO_RENDEZVOUS_PORT", 0)
    return LaunchEnv(
        world_size=_int(env, "HOROVOD_SIZE"),
        rank=_int(env, "HOROVOD_RANK"),
        local_rank=_int(env, "HOROVOD_LOCAL_RANK", 0),
        local_size=_int(env, "HOROVOD_LOCAL_SIZE", 1),
        node_rank=_int(env, "HOROVOD_CROSS_RANK", 0),
        coordinator_address=addr,
        # horovodrun picks a free rendezvous port; the next one up is ours for JAX.
        coordinator_port=rdv_port + 1 if rdv_port else _port_for(str(os.getppid())),
        launcher="horovodrun",
        num_nodes=_int(env, "HOROVOD_CROSS_SIZE", 1),
    )


def _from_slurm(env: Mapping[str, str]) -> LaunchEnv:
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
    job, step = env.get("SLURM_JOB_ID", "0"), env.get("SLURM_STEP_ID", env.get("SLURM_STEPID",
                                                                            "0"))
    reserved = _reserved_port(env)
    return LaunchEnv(
        world_size=_int(env, "SLURM_STEP_NUM_TASKS", _int(env, "SLURM_NTASKS", 1)),
        rank=_int(env, "SLURM_PROCID"),
        local_rank=_int(env, "SLURM_LOCALID", 0),
        local_size=_slurm_local_size(env),
        node_rank=_int(env, "SLURM_NODEID", 0),
        coordinator_address=expand_nodelist(nodelist)[0],
        coordinator_port=reserved or _port_for(job, step),
        launcher="srun",
        num_nodes=_int(env, "SLURM_STEP_NUM_NODES", _int(env, "SLURM_NNODES", 1)),
        job="" if reserved else f"slurm {job}.{step}",
    )


def _reserved_port(env: Mapping[str, str]) -> int | None:
    """The first port Slurm reserved for this step (``srun --resv-ports=1`` with
    ``MpiParams=ports=...`` in slurm.conf): no other step on the node holds it."""
    spec = env.get("SLURM_STEP_RESV_PORTS", "")
    match = re.match(r"\s*(\d+)", spec)
    return int(match.group(1)) if match else None


def _slurm_local_size(env: Mapping[str, str]) -> int:
    # SLURM_STEP_TASKS_PER_NODE looks like "2(x3),1": tasks on each node of the step, in order.
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not spec:
        return _int(env, "SLURM_NTASKS", 1)
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise ToolkitError(f"cannot read SLURM_STEP_TASKS_PER_NODE={spec!r}",
                               "expected a value such as '2(x3),1'")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    node = _int(env, "SLURM_NODEID", 0)
    return counts[node] if node < len(counts) else counts[-1]


def _from_openmpi(env: Mapping[str, str]) -> LaunchEnv:
    # mpirun's own URI names the host it runs on, which is where rank 0 is placed first when
    # that host is one of the job's nodes; JAX's OmpiCluster makes the same choice.
    uri = env.get("OMPI_MCA_orte_hnp_uri", "")
    match = re.search(r"tcp://([^,:;/]+)", uri)
    job = uri.split(";")[0].split(".")[0] if uri else str(os.getppid())
    return LaunchEnv(
        world_size=_int(env, "OMPI_COMM_WORLD_SIZE"),
        rank=_int(env, "OMPI_COMM_WORLD_RANK"),
        local_rank=_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0),
        local_size=_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", 1),
        node_rank=_openmpi_node(env),
        coordinator_address=match.group(1) if match else "127.0.0.1",
        coordinator_port=_port_for(job),
        launcher="mpirun",
        # the nodes the job's ranks are on (Open MPI 4's runtime, ORTE, says)
        num_nodes=_int(env, "OMPI_MCA_orte_num_nodes", 0),
        job=f"openmpi {job}",
    )


def _openmpi_node(env: Mapping[str, str]) -> int:
    """The index of the rank's node: that of the node's Open MPI daemon (mpirun's own node is
    0, the hostfile's other nodes follow in order; an mpirun started outside the job's nodes
    keeps 0, and theirs count from 1). OMPI_COMM_WORLD_NODE_RANK is no node index but the rank
    among the node's processes, like the local rank."""
    uri = env.get("OMPI_MCA_orte_local_daemon_uri", "")
    match = re.match(r"\s*\d+\.(\d+);", uri)
    if uri and match is None:
        raise ToolkitError(f"cannot read OMPI_MCA_orte_local_daemon_uri={uri!r}",
                           "expected Open MPI's 'JOB.DAEMON;tcp://...'; relaunch the job with "
                           "an unmodified mpirun environment")
    return int(match.group(1)) if match else 0


def _from_torchrun(env: Mapping[str, str]) -> LaunchEnv:
    return LaunchEnv(
        world_size=_int(env, "WORLD_SIZE"),
        rank=_int(env, "RANK"),
        local_rank=_int(env, "LOCAL_RANK", 0),
        local_size=_int(env, "LOCAL_WORLD_SIZE", 1),
        node_rank=_int(env, "GROUP_RANK", 0),
        coordinator_address=env.get("MASTER_ADDR", "127.0.0.1"),
        coordinator_port=_int(env, "MASTER_PORT", _PORT_BASE) + 1,
        launcher="torchrun",
        num_nodes=_int(env, "GROUP_WORLD_SIZE", 1),
    )


def detect_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Resolves the :class:`LaunchEnv` from a launcher's variables.

    Args:
        environ: the variables to read; ``os.environ`` when omitted.

    Raises:
        ToolkitError: when the variables describe a multi-process job this process was not
            started as part of (for example ``SLURM_NTASKS=2`` in a batch script that ran
            ``python train.py`` instead of ``srun python train.py``): training alone in a world
            of one would silently give a different result.
    """
    env = os.environ if environ is None else environ
    found = _detect(env)
    if env.get(PORT_VARIABLE, "").strip():  # (set but empty: unset)
        return dataclasses.replace(found, coordinator_port=_port_variable(env), job="")
    return found


def _port_variable(env: Mapping[str, str]) -> int:
    value = env[PORT_VARIABLE]
    if not value.strip().isdigit() or not 1024 <= int(value) <= 65535:
        raise ToolkitError(f"{PORT_VARIABLE}={value!r} is not a port between 1024 and 65535",
                           "name a free port on rank 0's node, the same for every rank, or "
                           "unset it to let the toolkit choose")
    return int(value)


def _detect(env: Mapping[str, str]) -> LaunchEnv:
    if "HOROVOD_RANK" in env and "HOROVOD_SIZE" in env:
        return _from_horovodrun(env)
    if "OMPI_COMM_WORLD_SIZE" in env:
        # mpirun inside a Slurm allocation starts its daemons with srun, so the ranks inherit
        # that step's SLURM_* variables; Open MPI's own variables are the truth then.
        return _from_openmpi(env)
    if "SLURM_JOB_ID" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env) \
            and "SLURM_PROCID" in env:
        return _from_slurm(env)
    if "RANK" in env and "WORLD_SIZE" in env:
        return _from_torchrun(env)
    for name in ("PMI_SIZE", "SLURM_NTASKS"):
        if name in env:
            _reject_orphan(env, name)
    return LaunchEnv()


def _reject_orphan(env: Mapping[str, str], name: str) -> None:
    if name == "SLURM_NTASKS":
        ntasks = _int(env, "SLURM_NTASKS", 1)
        if ntasks > 1:
            raise ToolkitError(
                f"SLURM_NTASKS={ntasks}, but this process was not started by srun "
                "(no SLURM_STEP_ID): it would train alone as a world of 1",
                f"start it with 'srun -n {ntasks} --mpi=pmix python ...' inside the job, "
                "or ask for --ntasks=1",
            )
    elif name == "PMI_SIZE" and _int(env, "PMI_SIZE", 1) > 1:
        raise ToolkitError(
            f"PMI_SIZE={env['PMI_SIZE']} but no launcher this toolkit knows started the process",
            "launch with horovodrun, mpirun (Open MPI) or srun --mpi=pmix",
        )
