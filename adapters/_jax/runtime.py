"""The JAX runtime both JAX backends share: JAX configured for the launch environment and the
rank's device (the CPU with Gloo between processes, or GPUs with NCCL chosen by XLA; x64), and
host collectives."""

from __future__ import annotations

import contextlib
import os
import pkgutil
import sys
from typing import Any

import numpy as np

from adapters._common import check_world, missing_framework
from toolkit import LaunchEnv, ToolkitError
from toolkit.launch.cli import close_on_input_error
from toolkit.launch.coordinator import agreed_port, check_coordinator_host
from toolkit.launch.devices import Device, choose_device, count_gpus
from toolkit.models.specs import DTYPES, check_choice


def jax_gpus() -> int:
    """The GPUs JAX will see, counted before its runtime starts (it must be told a process's
    GPUs before then): none without JAX's CUDA plugin (``jax[cuda12]``), else the visible
    NVIDIA GPUs (``toolkit.launch.devices.count_gpus``)."""
    if not any(m.name.startswith("jax_cuda") for m in pkgutil.iter_modules()):
        return 0
    return count_gpus()


def local_device_ids(device: Device, env: LaunchEnv) -> list[int] | None:
    """The GPUs a process drives, for ``jax.distributed.initialize``: a process per GPU takes
    its local rank's (``device.index``); one process per node (or a CPU run) drives what it
    sees (None).

        >>> local_device_ids(Device("gpu", 3), LaunchEnv(world_size=8, rank=3, local_rank=3,
        ...                                               local_size=4))
        [3]
        >>> local_device_ids(Device("gpu", 0), LaunchEnv(world_size=2, rank=1)) is None
        True
    """
    return [device.index] if device.kind == "gpu" and env.local_size > 1 else None


def import_jax(backend: str, env: LaunchEnv, dtype: str, local_devices: int | None,
               device: Device | None = None):
    """Imports and configures JAX for ``env`` and the rank's ``device``: the CPU (its
    ``local_devices``) or GPUs, x64, and the distributed runtime.

    The coordinator comes from the launch environment (horovodrun, srun or mpirun), so the
    same script needs no JAX-specific flags under any launcher.
    """
    try:
        import jax
    except ImportError as err:
        raise missing_framework(backend, "JAX (jax, jaxlib, flax, optax)", err) from err
    try:
        device = device or Device("cpu")
        if device.kind == "cpu":  # a GPU node's GPUs stay out of the run
            jax.config.update("jax_platforms", "cpu")
        if local_devices:
            jax.config.update("jax_num_cpu_devices", int(local_devices))
        if dtype == "float64":
            jax.config.update("jax_enable_x64", True)
        if env.world_size > 1:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except RuntimeError as err:  # the backend already started with other settings
        raise ToolkitError(f"{backend}: JAX was initialised before the adapter ({err})",
                           "create the adapter before any other JAX computation") from err
    if env.world_size > 1 and not jax.distributed.is_initialized():
        check_coordinator_host(env)  # (rank 0 serves it: a wrong host would hang every rank)
        port = agreed_port(env)  # (a port derived from the job's id may be another job's)
        jax.distributed.initialize(coordinator_address=f"{env.coordinator_address}:{port}",
                                   num_processes=env.world_size, process_id=env.rank,
                                   local_device_ids=local_device_ids(device, env))
        close_on_input_error(jax.distributed.shutdown)
    if dtype == "float64" and not jax.config.jax_enable_x64:
        raise ToolkitError(f"{backend} cannot run float64: JAX started without x64",
                           "set JAX_ENABLE_X64=1, or create the adapter before using JAX")
    check_world(backend, env, jax.process_count(), jax.process_index())
    return jax



@contextlib.contextmanager
def gloo_connect_line_silenced():
    """Gloo inside jaxlib prints "[Gloo] Rank 0 is connected to 1 peer ranks..." to the C-level
    stdout when the processes first connect; a user should see only what the toolkit prints.
    The process's stdout file descriptor points at /dev/null for that one call (stderr, where
    errors go, is untouched); C stdio is flushed before it is restored."""
    import ctypes

    sys.stdout.flush()
    saved, devnull = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    try:
        yield
    finally:
        ctypes.CDLL(None).fflush(None)
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)



class JaxRuntime:
    """JAX for one backend (``backend`` names it in errors), set up once per process."""

    backend = "jax"
    env: Any = None
    jax: Any = None
    _first_allreduce = True

    def __init__(self, dtype: str = "float32", local_devices: int | None = None):
        check_choice("dtype", dtype, DTYPES)
        if local_devices is not None and local_devices < 1:
            raise ToolkitError(f"local_devices={local_devices} must be >= 1",
                               "pass the number of CPU devices per process, e.g. 2")
        self.dtype_name, self.local_devices = dtype, local_devices

    def setup(self, env: LaunchEnv, layout: Any = None, device: str = "auto") -> None:
        """Configures JAX for ``env`` and ``device`` (once: set up again, e.g. after a Flax
        init, it keeps what it has)."""
        if self.env == env:
            return
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        self.env = env
        self.device = choose_device(device, jax_gpus(), env.local_rank, env.local_size)
        self.jax = import_jax(self.backend, env, self.dtype_name, self.local_devices,
                              self.device)
        seen = [d for d in self.jax.local_devices() if d.platform == "gpu"]
        if self.device.kind == "gpu" and not seen:
            raise ToolkitError(
                f"{self.backend}: device {self.device} was chosen, but JAX sees no GPU "
                f"(its devices: {', '.join(self.device_names())})",
                "install JAX's CUDA build matching the driver (tools/install.sh --gpu), or "
                "pass --device cpu")
        import jax.numpy as jnp

        self.jnp = jnp
        self.dtype = jnp.dtype(self.dtype_name)

    def local_device_count(self) -> int:
        """Devices this process computes on (``toolkit.contract.DrivesDevices``)."""
        return self.jax.local_device_count()

    def device_names(self) -> list[str]:
        return [f"{d.platform}:{d.id}" for d in self.jax.local_devices()]

    def allreduce(self, values: np.ndarray, op: str = "mean") -> np.ndarray:
        check_choice("reduction", op, ("mean", "sum"))
        values = np.asarray(values, np.float64)
        if self.env.world_size == 1:
            return values.copy()
        from jax.experimental import multihost_utils

        # float64 travels as two float32 halves when x64 is off: gather the exact bytes.
        raw = values.view(np.uint32) if values.size else values
        # (the first one may be the processes' first collective: Gloo's connect line)
        quiet = gloo_connect_line_silenced() if self._first_allreduce else contextlib.nullcontext()
        with quiet:
            gathered = np.asarray(multihost_utils.process_allgather(raw))
        self._first_allreduce = False
        stacked = gathered.view(np.float64).reshape((self.env.world_size,) + values.shape)
        total = stacked.sum(axis=0)
        return total / self.env.world_size if op == "mean" else total

    def broadcast(self, values: np.ndarray, root: int = 0) -> np.ndarray:
        values = np.asarray(values)
        if self.env.world_size == 1:
            return values.copy()
        from jax.experimental import multihost_utils

        raw = values.view(np.uint8)
        gathered = np.asarray(multihost_utils.process_allgather(raw))
        return gathered.reshape((self.env.world_size,) + raw.shape)[root].view(
            values.dtype).reshape(values.shape)

    def barrier(self) -> None:
        if self.env.world_size > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("toolkit-barrier")

    def shutdown(self) -> None:
        if self.env.world_size > 1:
            self.jax.distributed.shutdown()
