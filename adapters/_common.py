"""Small pieces several adapters share (framework-free)."""

from __future__ import annotations

from toolkit import ToolkitError
from toolkit._specs import DTYPES, check_choice


class BackendBase:
    """What every adapter's constructor does: check and keep the dtype."""

    name = "backend"

    def __init__(self, dtype: str = "float32"):
        check_choice("dtype", dtype, DTYPES)
        self.dtype_name = dtype


def missing_framework(backend: str, what: str, err: BaseException) -> ToolkitError:
    """The error for a backend whose framework (or Horovod build) is not installed."""
    return ToolkitError(
        f"backend {backend!r} needs {what}, which is not importable here ({err})",
        "run 'tools/install.sh' (it installs the pinned frameworks and builds Horovod with "
        "HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1), or choose another --backend",
    )


def check_world(backend: str, env, size: int, rank: int) -> None:
    """Fails when the framework's communicator disagrees with the launch environment."""
    if (size, rank) != (env.world_size, env.rank):
        raise ToolkitError(
            f"{backend}: the communicator has rank {rank} of {size}, but the launcher "
            f"({env.launcher}) started rank {env.rank} of {env.world_size}",
            "launch with horovodrun -np N, mpirun -np N or srun -n N --mpi=pmix",
        )
