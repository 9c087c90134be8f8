"""The launch environment, from tables of real-looking launcher variables."""

import pytest

from toolkit import LaunchEnv, ToolkitError, detect_launch_env, expand_nodelist


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
}

CASES = {
    "single process": ({}, LaunchEnv()),
    "horovodrun gloo": (
        {"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": "1",
         "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_CROSS_RANK": "0",
         "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.1.2.3", "HOROVOD_GLOO_RENDEZVOUS_PORT": "40000"},
        LaunchEnv(2, 1, 1, 2, 0, "10.1.2.3", 40001, "horovodrun")),
    "srun two nodes": (SRUN_2_NODES, LaunchEnv(4, 3, 1, 2, 1, "node07", 24840, "srun")),
    "srun uneven tasks per node": (
        {**SRUN_2_NODES, "SLURM_STEP_NUM_TASKS": "3", "SLURM_NTASKS": "3", "SLURM_PROCID": "2",
         "SLURM_LOCALID": "0", "SLURM_STEP_TASKS_PER_NODE": "2,1"},
        LaunchEnv(3, 2, 0, 1, 1, "node07", 24840, "srun")),
    "mpirun": (
        {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "2",
         "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
         "OMPI_COMM_WORLD_NODE_RANK": "1",
         "OMPI_MCA_orte_hnp_uri": "1234567.0;tcp://10.0.0.5,172.17.0.2:45123"},
        LaunchEnv(4, 2, 0, 2, 1, "10.0.0.5", 20000 + 567 * 20, "mpirun")),
    "mpirun inside a Slurm allocation": (
        {**SRUN_2_NODES, "SLURM_PROCID": "0", "OMPI_COMM_WORLD_SIZE": "4",
         "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
         "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_NODE_RANK": "1",
         "OMPI_MCA_orte_hnp_uri": "99.0;tcp://node07:1"},
        LaunchEnv(4, 3, 1, 2, 1, "node07", 20000 + 99 * 20, "mpirun")),
    "torchrun": (
        {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
         "GROUP_RANK": "1", "MASTER_ADDR": "host-a", "MASTER_PORT": "29500"},
        LaunchEnv(8, 5, 1, 4, 1, "host-a", 29501, "torchrun")),
    "sbatch with one task runs python directly": (
        {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}, LaunchEnv()),
}


@pytest.mark.parametrize("name", list(CASES))
def test_environment_table(name):
    environ, expected = CASES[name]
    assert detect_launch_env(environ) == expected


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


def test_launch_env_is_frozen():
    env = LaunchEnv()
    with pytest.raises(AttributeError):
        env.rank = 1  # type: ignore[misc]
