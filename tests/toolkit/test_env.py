"""The launch environment, from tables of real-looking launcher variables."""

import dataclasses
import os
import random

import pytest

from toolkit import LaunchEnv, ToolkitError, detect_launch_env, expand_nodelist
from toolkit.launch.coordinator import check_coordinator_host, is_local_address
from toolkit.launch.env import _port_for


@pytest.mark.parametrize("nodelist, hosts", [
    ("node01", ["node01"]),
    ("node[01-04]", ["node01", "node02", "node03", "node04"]),
    ("a1,b[2-3]", ["a1", "b2", "b3"]),
    ("gpu[1,3,5-6]", ["gpu1", "gpu3", "gpu5", "gpu6"]),
    ("n[08-10]", ["n08", "n09", "n10"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("c[001-002],d5,e[7]", ["c001", "c002", "d5", "e7"]),
    ("127.0.0.1", ["127.0.0.1"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["node[01-x]", "node[", ""])
def test_bad_nodelist_is_a_clear_error(bad):
    with pytest.raises(ToolkitError, match="nodelist"):
        expand_nodelist(bad)


SRUN_2_NODES = {
    "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "4",
    "SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1", "SLURM_STEP_NODELIST": "node[07-08]",
    "SLURM_JOB_NODELIST": "node[07-08]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    "SLURM_STEP_NUM_NODES": "2",
}

MPIRUN_2_NODES = {
    "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_NODE_RANK": "0",
    "OMPI_MCA_orte_hnp_uri": "247332864.0;tcp://10.77.0.11:60513",
    "OMPI_MCA_orte_local_daemon_uri": "247332864.1;tcp://10.77.0.12:48111",
    "OMPI_MCA_orte_num_nodes": "2",
}

# The coordinator port derived from a job id: any free port will do, so the table leaves its
# value open and the tests after it check what matters (the same for every rank of a step,
# different for concurrent jobs and steps).
DERIVED = None

CASES = {
    "single process": ({}, LaunchEnv()),
    "horovodrun gloo": (
        {"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": "1",
         "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_CROSS_RANK": "0",
         "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.1.2.3", "HOROVOD_GLOO_RENDEZVOUS_PORT": "40000"},
        LaunchEnv(2, 1, 1, 2, 0, "10.1.2.3", 40001, "horovodrun")),
    "srun two nodes": (SRUN_2_NODES, LaunchEnv(4, 3, 1, 2, 1, "node07", DERIVED, "srun", 2)),
    "srun uneven tasks per node": (
        {**SRUN_2_NODES, "SLURM_STEP_NUM_TASKS": "3", "SLURM_NTASKS": "3", "SLURM_PROCID": "2",
         "SLURM_LOCALID": "0", "SLURM_STEP_TASKS_PER_NODE": "2,1"},
        LaunchEnv(3, 2, 0, 1, 1, "node07", DERIVED, "srun", 2)),
    # Open MPI 4.1's mpirun -hostfile (node1 slots=2, node2 slots=2) started on node1, rank 2
    # on node2: OMPI_COMM_WORLD_NODE_RANK is the rank among the node's processes, the node is
    # its daemon's (mpirun's own node is daemon 0).
    "mpirun, second node": (MPIRUN_2_NODES, LaunchEnv(4, 2, 0, 2, 1, "10.77.0.11", DERIVED,
                                                      "mpirun", 2)),
    "mpirun, first node": (
        {**MPIRUN_2_NODES, "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
         "OMPI_COMM_WORLD_NODE_RANK": "1",
         "OMPI_MCA_orte_local_daemon_uri": "247332864.0;tcp://10.77.0.11:60513"},
        LaunchEnv(4, 1, 1, 2, 0, "10.77.0.11", DERIVED, "mpirun", 2)),
    "mpirun inside a Slurm allocation": (
        {**SRUN_2_NODES, "SLURM_PROCID": "0", "OMPI_COMM_WORLD_SIZE": "4",
         "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
         "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_NODE_RANK": "1",
         "OMPI_MCA_orte_hnp_uri": "99.0;tcp://node07:1",
         "OMPI_MCA_orte_local_daemon_uri": "99.1;tcp://node08:2", "OMPI_MCA_orte_num_nodes": "2"},
        LaunchEnv(4, 3, 1, 2, 1, "node07", DERIVED, "mpirun", 2)),
    "torchrun": (
        {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
         "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "host-a",
         "MASTER_PORT": "29500"},
        LaunchEnv(8, 5, 1, 4, 1, "host-a", 29501, "torchrun", 2)),
    "sbatch with one task runs python directly": (
        {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}, LaunchEnv()),
    "horovodrun, second node": (
        {"HOROVOD_RANK": "3", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1",
         "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_CROSS_RANK": "1", "HOROVOD_CROSS_SIZE": "2",
         "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.1.2.3", "HOROVOD_GLOO_RENDEZVOUS_PORT": "40000"},
        LaunchEnv(4, 3, 1, 2, 1, "10.1.2.3", 40001, "horovodrun", 2)),
    "srun step on part of the allocation": (
        {**SRUN_2_NODES, "SLURM_NTASKS": "16", "SLURM_JOB_NODELIST": "node[01-08]"},
        LaunchEnv(4, 3, 1, 2, 1, "node07", DERIVED, "srun", 2)),
    "srun of an older Slurm (SLURM_STEPID, no step variables)": (
        {"SLURM_JOB_ID": "7", "SLURM_STEPID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "4",
         "SLURM_LOCALID": "1", "SLURM_NODEID": "0", "SLURM_TASKS_PER_NODE": "2(x2)",
         "SLURM_JOB_NODELIST": "vm[1-2]"},
        LaunchEnv(4, 1, 1, 2, 0, "vm1", DERIVED, "srun")),
    "srun without tasks per node": (
        {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "2",
         "SLURM_LOCALID": "1"},
        LaunchEnv(2, 1, 1, 2, 0, "127.0.0.1", DERIVED, "srun")),
    "srun uneven tasks per node, first node": (
        {**SRUN_2_NODES, "SLURM_STEP_NUM_TASKS": "3", "SLURM_NTASKS": "3", "SLURM_PROCID": "1",
         "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "2,1"},
        LaunchEnv(3, 1, 1, 2, 0, "node07", DERIVED, "srun", 2)),
    "srun tasks per node without SLURM_NODEID: the first node's": (
        {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "3",
         "SLURM_LOCALID": "1", "SLURM_STEP_TASKS_PER_NODE": "2,1"},
        LaunchEnv(3, 1, 1, 2, 0, "127.0.0.1", DERIVED, "srun")),
    "srun tasks per node shorter than the nodes: the last count": (
        {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "12",
         "SLURM_LOCALID": "2", "SLURM_NODEID": "3", "SLURM_STEP_TASKS_PER_NODE": "1,2,3"},
        LaunchEnv(12, 0, 2, 3, 3, "127.0.0.1", DERIVED, "srun")),
    # Only the variables a launcher must set: the others take their one-node defaults.
    "horovodrun, required variables only": (
        {"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2"},
        LaunchEnv(2, 1, 0, 1, 0, "127.0.0.1", DERIVED, "horovodrun")),
    "srun, required variables only": (
        {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0"},
        LaunchEnv(1, 0, 0, 1, 0, "127.0.0.1", DERIVED, "srun")),
    "mpirun, required variables only": (
        {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"},
        LaunchEnv(2, 1, 0, 1, 0, "127.0.0.1", DERIVED, "mpirun", 0)),
    "torchrun, required variables only": (
        {"RANK": "1", "WORLD_SIZE": "2"},
        LaunchEnv(2, 1, 0, 1, 0, "127.0.0.1", DERIVED, "torchrun")),
    # Part of a launcher's variables is not that launcher; one MPI process alone is no job.
    "HOROVOD_RANK alone": ({"HOROVOD_RANK": "1"}, LaunchEnv()),
    "HOROVOD_SIZE alone": ({"HOROVOD_SIZE": "2"}, LaunchEnv()),
    "RANK alone": ({"RANK": "3"}, LaunchEnv()),
    "WORLD_SIZE alone": ({"WORLD_SIZE": "2"}, LaunchEnv()),
    "PMI_SIZE=1": ({"PMI_SIZE": "1", "PMI_RANK": "0"}, LaunchEnv()),
}


@pytest.mark.parametrize("name", list(CASES))
def test_environment_table(name):
    environ, expected = CASES[name]
    got = detect_launch_env(environ)
    if expected.coordinator_port is DERIVED:
        assert isinstance(got.coordinator_port, int) and 1024 <= got.coordinator_port < 65536
        got = dataclasses.replace(got, coordinator_port=DERIVED)
    assert got == expected


def srun_port(job_id, step_id=0, rank=0):
    """The coordinator port that rank ``rank`` of a 4-task srun step resolves."""
    environ = {**SRUN_2_NODES, "SLURM_JOB_ID": str(job_id), "SLURM_STEP_ID": str(step_id),
               "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank % 2),
               "SLURM_NODEID": str(rank // 2)}
    return detect_launch_env(environ).coordinator_port


def test_every_rank_of_a_step_agrees_on_the_port():
    for job in (7, 4242, 1_234_567):
        assert len({srun_port(job, 0, rank) for rank in range(4)}) == 1


@pytest.mark.parametrize("jobs", [
    [4242, 4243],  # submitted one after the other
    list(range(100_000, 100_500)),  # 500 jobs in flight at once on a busy cluster
    # a random sample of many ids, all from one stretch of 999 submissions
    sorted(random.Random(0).sample(range(73_001, 74_000), 300)),
])
def test_concurrent_slurm_jobs_get_different_ports(jobs):
    ports = [srun_port(job) for job in jobs]
    assert len(set(ports)) == len(jobs)
    # the ports of a job's steps do not reach into another job's either
    steps = {srun_port(job, step) for job in jobs[:50] for step in range(3)}
    assert len(steps) == 3 * len(jobs[:50])


def agree_in_threads(envs: list[LaunchEnv], timeout: float = 20.0) -> list[int]:
    """What ``agreed_port`` returns on each of ``envs`` (ranks of one or more jobs on this
    machine), each in its own thread, all at once."""
    import threading

    from toolkit.launch.coordinator import agreed_port

    got: list = [None] * len(envs)

    def run(i):
        try:
            got[i] = agreed_port(envs[i], timeout=timeout)
        except Exception as err:  # reported by the assertion below
            got[i] = err

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(envs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    return got


def slurm_ranks(job_id: int, world: int = 3) -> list[LaunchEnv]:
    """The launch environments of a ``world``-task srun step of job ``job_id`` on this one
    node (its coordinator address 127.0.0.1)."""
    return [detect_launch_env({
        "SLURM_JOB_ID": str(job_id), "SLURM_STEP_ID": "0", "SLURM_NTASKS": str(world),
        "SLURM_STEP_NUM_TASKS": str(world), "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r),
        "SLURM_STEP_TASKS_PER_NODE": str(world), "SLURM_STEP_NODELIST": "127.0.0.1",
        "SLURM_NNODES": "1"}) for r in range(world)]


def test_jobs_1000_ids_apart_on_one_node_get_different_ports():
    """Job 4242 and job 5242 derive the same starting port (ids 1000 apart), and start on one
    node at once: each job's rank 0 takes a free port and answers its own ranks (asking with
    their job's identity) on the first meeting port it can bind; every rank of a job gets its
    rank 0's port, and the two jobs' ports differ."""
    first, second = slurm_ranks(4242), slurm_ranks(5242)
    assert first[0].coordinator_port == second[0].coordinator_port  # (where they meet)
    assert first[0].job == "slurm 4242.0" and second[0].job == "slurm 5242.0"
    # every rank of both jobs at once, each job's rank 0 last (its ranks wait for it)
    got = agree_in_threads([*first[1:], *second[1:], first[0], second[0]])
    assert all(isinstance(p, int) for p in got), got
    a, b = got[:2] + got[4:5], got[2:4] + got[5:]
    assert len(set(a)) == 1 and len(set(b)) == 1 and a[0] != b[0], got


def test_a_reserved_or_named_port_is_the_port_itself():
    from toolkit.launch.coordinator import agreed_port

    reserved = detect_launch_env({**SRUN_2_NODES, "SLURM_STEP_RESV_PORTS": "12000-12003"})
    named = detect_launch_env({**SRUN_2_NODES, "TOOLKIT_COORDINATOR_PORT": "23456"})
    assert (reserved.job, named.job) == ("", "")
    assert agreed_port(reserved) == 12000 and agreed_port(named) == 23456  # (asks no one)


def test_a_rank_whose_rank_0_never_answers_is_told_so():
    (_, rank1) = slurm_ranks(777, world=2)
    (got,) = agree_in_threads([rank1], timeout=0.5)
    assert isinstance(got, ToolkitError), got
    assert "rank 1 found no answer from rank 0 on 127.0.0.1" in str(got)
    assert "TOOLKIT_COORDINATOR_PORT" in str(got)


def test_the_port_slurm_reserved_for_the_step_wins_over_the_derived_one():
    # srun --resv-ports=1 (with MpiParams=ports=... in slurm.conf): Slurm gives no two steps on
    # a node the same ports, whatever their job ids; tests/test_slurm_ports.py runs it.
    for ports, expected in (("12000-12003", 12000), ("12007", 12007), (" 12010-12011", 12010)):
        environ = {**SRUN_2_NODES, "SLURM_STEP_RESV_PORTS": ports}
        assert detect_launch_env(environ).coordinator_port == expected
    for unset in ("", "none"):
        environ = {**SRUN_2_NODES, "SLURM_STEP_RESV_PORTS": unset}
        assert detect_launch_env(environ).coordinator_port == srun_port(4242)


@pytest.mark.parametrize("launcher", ["srun two nodes", "mpirun, second node", "horovodrun gloo",
                                      "single process"])
def test_the_port_variable_names_the_port_under_every_launcher(launcher):
    environ = {**CASES[launcher][0], "SLURM_STEP_RESV_PORTS": "12000-12001",
               "TOOLKIT_COORDINATOR_PORT": "23456"}
    found = detect_launch_env(environ)
    assert found.coordinator_port == 23456
    assert dataclasses.replace(found, coordinator_port=0) == dataclasses.replace(
        detect_launch_env(CASES[launcher][0]), coordinator_port=0)


@pytest.mark.parametrize("bad", ["0", "80", "65536", "2x", "-3", "  "])
def test_a_bad_port_variable_is_a_clear_error(bad):
    environ = {**SRUN_2_NODES, "TOOLKIT_COORDINATOR_PORT": bad}
    if not bad.strip():  # empty: unset
        assert detect_launch_env(environ).coordinator_port == srun_port(4242)
        return
    with pytest.raises(ToolkitError) as err:
        detect_launch_env(environ)
    assert str(err.value) == (
        f"TOOLKIT_COORDINATOR_PORT={bad!r} is not a port between 1024 and 65535\nHINT: name a "
        "free port on rank 0's node, the same for every rank, or unset it to let the toolkit "
        "choose")


def test_the_steps_of_one_job_get_different_ports():
    assert len({srun_port(4242, step) for step in range(10)}) == 10


def test_ports_are_unprivileged_and_a_jobs_steps_stay_in_its_own_ports():
    for job in range(0, 3000, 7):
        ports = {srun_port(job, step) for step in range(45)}
        assert all(1024 <= port < 65536 for port in ports)
        # more than 20 steps wrap around inside the job's ports, never into the next job's
        assert not ports & {srun_port(job + 1, step) for step in range(45)}


def test_an_older_slurms_step_variable_gives_the_same_port():
    environ = {**SRUN_2_NODES, "SLURM_STEP_ID": "3"}
    older = {k: v for k, v in environ.items() if k != "SLURM_STEP_ID"} | {"SLURM_STEPID": "3"}
    assert detect_launch_env(older).coordinator_port == detect_launch_env(environ).coordinator_port
    assert detect_launch_env(older).coordinator_port != srun_port(4242, 0)


def test_ids_are_read_by_their_digits():
    assert _port_for("job-4242", "step.3") == _port_for("4242", "3")
    assert _port_for("", "extern") == _port_for("0", "0")


def mpirun_port(job, node, monkeypatch):
    """The port a rank on node ``node`` of mpirun job ``job`` resolves: each node's ranks are
    children of that node's daemon, so their parent process differs between nodes."""
    monkeypatch.setattr(os, "getppid", lambda: 1000 + node)
    return detect_launch_env({
        "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": str(2 * node),
        "OMPI_COMM_WORLD_NODE_RANK": str(node), "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "OMPI_MCA_orte_hnp_uri": f"{job}.0;tcp://10.0.0.5,172.17.0.2:45123"}).coordinator_port


def test_mpirun_ranks_agree_on_the_port_and_concurrent_jobs_differ(monkeypatch):
    assert mpirun_port(1234567, 0, monkeypatch) == mpirun_port(1234567, 1, monkeypatch)
    ports = [mpirun_port(job, 0, monkeypatch) for job in range(100_000, 100_500)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= port < 65536 for port in ports)


@pytest.mark.parametrize("environ", [
    {"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2"},  # no Gloo rendezvous port
    {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"},  # no mpirun URI
])
def test_without_a_job_id_the_port_follows_the_launching_process(environ, monkeypatch):
    ports = {}
    for parent in (4242, 4243, 4242):
        monkeypatch.setattr(os, "getppid", lambda parent=parent: parent)
        ports.setdefault(parent, set()).add(detect_launch_env(environ).coordinator_port)
    assert all(len(p) == 1 for p in ports.values())  # the same launcher, the same port
    assert ports[4242] != ports[4243]
    assert all(1024 <= p < 65536 for p in ports[4242] | ports[4243])


def test_os_environ_is_read_when_no_variables_are_given(monkeypatch):
    monkeypatch.setattr(os, "environ", {"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "29500"})
    assert detect_launch_env() == LaunchEnv(2, 1, 0, 1, 0, "127.0.0.1", 29501, "torchrun")


def test_sbatch_python_without_srun_is_an_error_not_a_world_of_one():
    environ = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_PROCID": "0",
               "SLURM_JOB_NODELIST": "vm"}
    with pytest.raises(ToolkitError) as err:
        detect_launch_env(environ)
    assert "SLURM_NTASKS=2" in str(err.value) and "srun -n 2" in str(err.value)


@pytest.mark.parametrize("environ, match", [
    ({"HOROVOD_RANK": "2", "HOROVOD_SIZE": "2"}, "rank=2, world_size=2"),
    ({"OMPI_COMM_WORLD_SIZE": "two", "OMPI_COMM_WORLD_RANK": "0"}, "'two' is not an integer"),
    ({"PMI_SIZE": "4", "PMI_RANK": "0"}, "PMI_SIZE=4"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2"},
     "local_rank=3"),
])
def test_inconsistent_environments_are_errors_with_a_hint(environ, match):
    with pytest.raises(ToolkitError, match=match) as err:
        detect_launch_env(environ)
    assert "HINT:" in str(err.value)


@pytest.mark.parametrize("call, message", [
    (lambda: expand_nodelist(""), "cannot read the Slurm nodelist ''\n"
     "HINT: expected a hostlist such as 'node[01-04]' or 'a1,b[2-3]'"),
    (lambda: expand_nodelist("node01]"), "cannot read the Slurm nodelist item 'node01]'\n"
     "HINT: expected a hostlist such as 'node[01-04]'"),
    (lambda: expand_nodelist("node["), "cannot read the Slurm nodelist item 'node['\n"
     "HINT: expected a hostlist such as 'node[01-04]'"),
    (lambda: expand_nodelist("node[01-x]"),
     "cannot read the range '01-x' in Slurm nodelist item 'node[01-x]'\n"
     "HINT: expected numeric ranges such as 'node[01-04,07]'"),
    (lambda: detect_launch_env({"OMPI_COMM_WORLD_SIZE": "2"}),
     "the launcher set no OMPI_COMM_WORLD_RANK\n"
     "HINT: relaunch the job with an unmodified launcher environment"),
    (lambda: detect_launch_env({"OMPI_COMM_WORLD_SIZE": "two", "OMPI_COMM_WORLD_RANK": "0"}),
     "OMPI_COMM_WORLD_SIZE='two' is not an integer\n"
     "HINT: relaunch the job instead of setting rank variables by hand"),
    (lambda: detect_launch_env({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_PROCID": "0"}),
     "SLURM_NTASKS=2, but this process was not started by srun (no SLURM_STEP_ID): it would "
     "train alone as a world of 1\nHINT: start it with 'srun -n 2 --mpi=pmix python ...' "
     "inside the job, or ask for --ntasks=1"),
    (lambda: detect_launch_env({**MPIRUN_2_NODES, "OMPI_MCA_orte_local_daemon_uri": "node2"}),
     "cannot read OMPI_MCA_orte_local_daemon_uri='node2'\n"
     "HINT: expected Open MPI's 'JOB.DAEMON;tcp://...'; relaunch the job with an unmodified "
     "mpirun environment"),
    (lambda: detect_launch_env({"PMI_SIZE": "2", "PMI_RANK": "0"}),
     "PMI_SIZE=2 but no launcher this toolkit knows started the process\n"
     "HINT: launch with horovodrun, mpirun (Open MPI) or srun --mpi=pmix"),
    (lambda: detect_launch_env({"HOROVOD_RANK": "2", "HOROVOD_SIZE": "2"}),
     "inconsistent launch environment: rank=2, world_size=2 (launcher horovodrun)\n"
     "HINT: the launcher's rank/size variables disagree; relaunch the job instead of setting "
     "them by hand"),
    (lambda: LaunchEnv(2, 0, local_rank=2, local_size=2),
     "inconsistent launch environment: local_rank=2, local_size=2 (launcher python)\n"
     "HINT: relaunch the job instead of setting rank variables by hand"),
    (lambda: detect_launch_env({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0",
                                "SLURM_STEP_TASKS_PER_NODE": "2x3"}),
     "cannot read SLURM_STEP_TASKS_PER_NODE='2x3'\nHINT: expected a value such as '2(x3),1'"),
])
def test_launch_errors_say_what_was_wrong_and_what_to_do(call, message):
    with pytest.raises(ToolkitError) as err:
        call()
    assert str(err.value) == message


def test_launch_env_is_frozen():
    env = LaunchEnv()
    with pytest.raises(AttributeError):
        env.rank = 1  # type: ignore[misc]


def test_an_address_of_this_host_is_local_and_others_are_not():
    assert is_local_address("127.0.0.1") and is_local_address("localhost")
    assert is_local_address("192.0.2.123") is False  # (TEST-NET-1: nobody's address)
    assert is_local_address("no-such-host.invalid") is None


def test_rank_0_away_from_the_launchers_host_is_an_error_naming_both():
    """horovodrun -H node2:2,node1:2 started on node1: rank 0 runs on node2, the rendezvous
    (the coordinator) on node1. Rank 0 says so at once instead of a hang."""
    env = detect_launch_env({"HOROVOD_RANK": "0", "HOROVOD_SIZE": "4",
                             "HOROVOD_GLOO_RENDEZVOUS_ADDR": "192.0.2.11",
                             "HOROVOD_GLOO_RENDEZVOUS_PORT": "40000"})
    with pytest.raises(ToolkitError) as err:
        check_coordinator_host(env)
    assert str(err.value).startswith(
        "the coordinator's address 192.0.2.11 (horovodrun's choice) is not an address of "), err
    assert str(err.value).endswith(
        "HINT: start horovodrun on the first host of -H (rank 0's), not on another host")
    check_coordinator_host(dataclasses.replace(env, rank=1))  # (only rank 0 can tell)
    check_coordinator_host(dataclasses.replace(env, coordinator_address="127.0.0.1"))
