"""Shared fixtures: real launchers (horovodrun, mpirun, srun) and a real local Slurm cluster."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

# The JAX backends run on 2 CPU devices in this process, so that in-process conformance tests
# exercise pmap's pmean and jit's sharded batch for real (set before anything imports JAX).
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
BIN = Path(PYTHON).parent


def child_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    # A test process may itself run under a launcher; children must not inherit its identity.
    for key in list(env):
        if key.startswith(("HOROVOD_", "OMPI_", "PMIX_", "PMI_", "SLURM_STEP", "SLURM_PROCID",
                           "XLA_FLAGS")):
            del env[key]
    env.update(PATH=f"{BIN}:{env.get('PATH', '')}", PYTHONUNBUFFERED="1",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", TF_CPP_MIN_LOG_LEVEL="2")
    env.update(extra or {})
    return env


# Run on node1 of the two-node cluster, where ssh reaches node2 (slurm/node_ssh/ssh).
ON_NODE1 = [str(ROOT / "slurm" / "local_cluster.sh"), "exec", "node1"]
# What the ranks an Open MPI daemon starts on another node get from this environment (mpirun's
# -x): the rest of theirs is that node's login environment.
FORWARDED = ("PATH", "PYTHONPATH", "PYTHONUNBUFFERED", "TF_CPP_MIN_LOG_LEVEL")


def launch_command(launcher: str, nproc: int, argv: list[str],
                   env: dict | None = None) -> list[str]:
    """The command line that starts ``python argv...`` on ``nproc`` ranks with ``launcher``
    (``env``: the environment it will run in; mpirun passes part of it to other nodes)."""
    py = [PYTHON, *argv]
    if launcher == "any":
        # A test whose subject is not the launcher. mpirun starts ranks in 0.1 s; horovodrun
        # first spends about 7 s here checking its own build by importing horovod.tensorflow
        # (TensorFlow) in a forked process, on every launch. Each launcher keeps its own tests
        # (test_example_launchers, test_failures, test_bring_your_own, test_gpt_example).
        launcher = "mpirun"
    if launcher == "python":
        assert nproc == 1
        return py
    if launcher == "horovodrun-gloo":
        return [str(BIN / "horovodrun"), "-np", str(nproc), "--gloo", *py]
    if launcher == "horovodrun-mpi":
        return [str(BIN / "horovodrun"), "-np", str(nproc), "--mpi", *py]
    if launcher == "mpirun":
        return ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(nproc), *py]
    if launcher == "srun":
        return ["srun", "-n", str(nproc), "--mpi=pmix", "--kill-on-bad-exit=1", *py]
    if launcher == "srun-2nodes":  # half the ranks on each node of the two-node cluster
        return ["srun", "-N", "2", f"--ntasks-per-node={nproc // 2}", "--mpi=pmix",
                "--kill-on-bad-exit=1", *py]
    # The two-node cluster's ranks, half on each node, started from node1 as from a node of
    # the allocation: mpirun with a hostfile (two slots per node), horovodrun with -H.
    if launcher == "mpirun-2nodes":
        env = os.environ if env is None else env
        forward = [arg for name in env if name in FORWARDED or name.startswith("TOOLKIT_")
                   for arg in ("-x", name)]
        return [*ON_NODE1, "mpirun", "--allow-run-as-root", "-hostfile",
                str(ROOT / "slurm" / "two_nodes.hostfile"), "-np", str(nproc), *forward, *py]
    if launcher in ("horovodrun-2nodes", "horovodrun-mpi-2nodes"):
        mode = "--mpi" if launcher == "horovodrun-mpi-2nodes" else "--gloo"
        hosts = f"node1:{nproc - nproc // 2},node2:{nproc // 2}"
        return [*ON_NODE1, str(BIN / "horovodrun"), "-np", str(nproc), "-H", hosts, mode, *py]
    if launcher == "srun-node1":  # every rank on node1 of the two-node cluster
        return ["srun", "-N", "1", "-w", "node1", "-n", str(nproc), "--mpi=pmix",
                "--kill-on-bad-exit=1", *py]
    if launcher == "torchrun":
        return [str(BIN / "torchrun"), "--nproc-per-node", str(nproc), *argv]
    raise ValueError(launcher)


class Job:
    """A finished launch: ``returncode``, ``stdout``, ``stderr``, ``seconds``, and what its
    ranks reported with ``tests/scripts/_emit.py``'s ``emit``: ``results_by_rank`` ({rank:
    [records]}) and ``results`` (every record, in rank order)."""

    def __init__(self, proc: subprocess.CompletedProcess, seconds: float,
                 results: Path | None = None):
        self.returncode, self.stdout, self.stderr = proc.returncode, proc.stdout, proc.stderr
        self.seconds = seconds
        self.results_by_rank: dict[int, list[dict]] = {}
        for path in sorted(results.glob("rank*.jsonl")) if results else []:
            self.results_by_rank[int(path.stem[4:])] = [
                json.loads(line) for line in path.read_text().splitlines()]
        self.results = [r for rank in sorted(self.results_by_rank)
                        for r in self.results_by_rank[rank]]

    def __repr__(self) -> str:
        return (f"Job(rc={self.returncode}, {self.seconds:.1f}s)\n--- stdout\n"
                f"{self.stdout[-3000:]}\n--- stderr\n{self.stderr[-3000:]}")


def visible_gpus() -> int:
    """GPUs torch sees here (0 without a CUDA build or a GPU)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` are skipped, with the reason, where torch sees no GPU (never
    silently: ``-ra`` lists them)."""
    gpu_tests = [item for item in items if item.get_closest_marker("gpu")]
    if gpu_tests and visible_gpus() == 0:
        skip = pytest.mark.skip(reason="needs a GPU: torch sees none here (make test-gpu on a "
                                       "GPU node)")
        for item in gpu_tests:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def slurm_cluster():
    """Starts the one-node Slurm cluster (unless one runs already) and stops what it started."""
    script = ROOT / "slurm" / "local_cluster.sh"
    if not shutil.which("slurmctld"):
        pytest.fail("Slurm is not installed: run 'tools/install.sh --slurm' (make test does)")
    conf = Path(os.environ.get("TOOLKIT_SLURM_DIR", "/tmp/hpc-toolkit-slurm")) / "slurm.conf"
    already = subprocess.run(["sinfo", "-h"], env={**os.environ, "SLURM_CONF": str(conf)},
                             capture_output=True).returncode == 0
    if not already:
        subprocess.run([str(script), "start"], check=True, capture_output=True, timeout=120)
    yield {"SLURM_CONF": str(conf)}
    if not already:
        subprocess.run([str(script), "stop"], capture_output=True, timeout=60)


@pytest.fixture(scope="session")
def two_node_cluster():
    """Starts the two-node cluster (``slurm/local_cluster.sh start --nodes 2``: network
    namespaces node1 and node2) and removes it, namespaces included, after the session."""
    if os.geteuid() != 0:
        pytest.skip("the two-node cluster makes network namespaces, which needs root")
    script = [str(ROOT / "slurm" / "local_cluster.sh")]
    proc = subprocess.run([*script, "start", "--nodes", "2"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    yield {"SLURM_CONF": proc.stdout.strip().rpartition("=")[2]}
    subprocess.run([*script, "stop", "--nodes", "2"], capture_output=True, timeout=60)


@pytest.fixture(scope="session")
def launch(request):
    """``launch(launcher, nproc, argv, timeout=..., env=...) -> Job``, with real launchers."""

    def run(launcher: str, nproc: int, argv: list[str], *, timeout: float = 240,
            env: dict | None = None) -> Job:
        extra = dict(env or {})
        if launcher == "srun":
            extra.update(request.getfixturevalue("slurm_cluster"))
        if launcher.endswith("-2nodes") or launcher == "srun-node1":
            extra.update(request.getfixturevalue("two_node_cluster"))
        with tempfile.TemporaryDirectory(prefix="results-") as results:
            extra.setdefault("TOOLKIT_TEST_RESULTS", results)
            environ = child_env(extra)
            start = time.monotonic()
            proc = subprocess.run(launch_command(launcher, nproc, argv, environ), cwd=ROOT,
                                  env=environ, capture_output=True, text=True,
                                  timeout=timeout, stdin=subprocess.DEVNULL)
            return Job(proc, time.monotonic() - start, Path(results))

    return run


@pytest.fixture
def read_metrics():
    """``read_metrics(path) -> {"steps": {step: loss}, "epochs": [records]}`` (JSON lines)."""

    def read(path: Path) -> dict:
        records = [json.loads(line) for line in Path(path).read_text().splitlines()]
        return {"steps": {r["step"]: r["loss"] for r in records if r["event"] == "step"},
                "epochs": [r for r in records if r["event"] == "epoch"]}

    return read


@pytest.fixture
def tensorboard_events():
    """``tensorboard_events(directory)``: TensorBoard's own reader (an ``EventAccumulator``)
    of the event files there, loaded. TensorBoard's stub of TensorFlow's file API stands in
    for TensorFlow (its "no TensorFlow" mode), which would take seconds to import."""
    import types

    sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("notf"))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def read(directory: Path) -> EventAccumulator:
        events = EventAccumulator(str(directory))
        events.Reload()
        return events

    return read


@pytest.fixture
def start():
    """``start(launcher, nproc, argv, env=...) -> Popen``: a job left running (killed after)."""
    procs = []

    def spawn(launcher: str, nproc: int, argv: list[str], env: dict | None = None):
        environ = child_env(env)
        proc = subprocess.Popen(launch_command(launcher, nproc, argv, environ), cwd=ROOT,
                                env=environ, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        procs.append(proc)
        return proc

    yield spawn
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()


class SlurmJobs:
    """Submit, signal and wait for batch jobs on the local cluster (real sbatch/scancel)."""

    def __init__(self, cluster_env: dict, tmp_path: Path):
        self.env = child_env({**cluster_env, "TOOLKIT_VENV": str(BIN.parent)})
        self.output = tmp_path / "slurm-job.out"

    def _run(self, *cmd: str, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, cwd=ROOT, env={**self.env, **kw.pop("env", {})},
                              capture_output=True, text=True, timeout=60, **kw)

    def submit(self, script: str, args: list[str], ntasks: int = 2, env: dict | None = None,
               nodes: int = 1):
        proc = self._run("sbatch", "--parsable", f"--ntasks={ntasks}", f"--nodes={nodes}",
                         f"--output={self.output}", script, *args, env=env or {})
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip().split(";")[0]

    def state(self, job: str) -> str:
        out = self._run("scontrol", "show", "job", job).stdout
        return out.split("JobState=")[1].split()[0] if "JobState=" in out else "GONE"

    def wait(self, job: str, timeout: float = 300) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.state(job)
            if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "GONE"):
                return state
            time.sleep(0.5)
        self._run("scancel", job)
        return "STILL RUNNING: cancelled by the test"

    def signal(self, job: str, name: str, batch_shell: bool = False) -> None:
        extra = ["--batch"] if batch_shell else []
        proc = self._run("scancel", f"--signal={name}", *extra, job)
        assert proc.returncode == 0, proc.stderr

    def start_requeued_now(self, job: str, timeout: float = 120) -> None:
        """Slurm holds a requeued batch job for about two minutes (BeginTime); lift that."""
        deadline = time.monotonic() + timeout
        while self.state(job) != "PENDING":
            assert time.monotonic() < deadline, f"job {job} was not requeued: {self.log()}"
            time.sleep(0.2)
        # ...but only once the node has let go of the previous run (as the delay intends).
        while self._run("sinfo", "-h", "-o", "%t").stdout.strip() != "idle":
            assert time.monotonic() < deadline, "the node never became idle"
            time.sleep(0.5)
        time.sleep(3)
        proc = self._run("scontrol", "update", f"JobId={job}", "StartTime=now")
        assert proc.returncode == 0, proc.stderr

    def log(self) -> str:
        return self.output.read_text() if self.output.exists() else ""


@pytest.fixture
def slurm_jobs(slurm_cluster, tmp_path):
    return SlurmJobs(slurm_cluster, tmp_path)


@pytest.fixture
def two_node_jobs(two_node_cluster, tmp_path):
    return SlurmJobs(two_node_cluster, tmp_path)


@pytest.fixture
def sbatch(slurm_jobs):
    """``sbatch(script, args, ntasks=2) -> (final job state, job output)``: submits and waits."""

    def submit(script: str, args: list[str], ntasks: int = 2, timeout: float = 300):
        job = slurm_jobs.submit(script, args, ntasks)
        return slurm_jobs.wait(job, timeout), slurm_jobs.log()

    return submit



_exit_status = {}


def pytest_sessionfinish(session, exitstatus):
    _exit_status["code"] = int(exitstatus)


def pytest_unconfigure(config):
    """Ends the test process without Horovod's atexit shutdown.

    This process loads Horovod's PyTorch and TensorFlow libraries side by side (a training
    script loads one); their shutdown then segfaults (in horovod/common/basics.py, also when
    called explicitly), which would turn a green run into exit status 139. Every result has
    been reported by now, so leave with pytest's own status.
    """
    if "horovod.torch" in sys.modules and "horovod.tensorflow" in sys.modules:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status.get("code", 1))
