"""Which device a rank computes on: the device option (``auto``, ``cpu``, ``gpu``) and the
local-rank -> GPU mapping, framework-free (a backend counts the GPUs its framework sees and asks
:func:`choose_device`).

The convention of the HPC courses (IDRIS's ``idr_torch``, the Horovod examples): rank ``r`` of
a node uses the node's GPU number ``local_rank``, among the GPUs ``CUDA_VISIBLE_DEVICES`` leaves
visible. Slurm's ``--gpus-per-task=1`` (or ``--gpu-bind=single:1``) instead gives every task one
GPU of its own, which is then the only one the task sees: GPU 0 of its view.

    >>> choose_device("auto", visible_gpus=0, local_rank=0, local_size=1)
    Device(kind='cpu', index=None)
    >>> choose_device("auto", visible_gpus=4, local_rank=3, local_size=4)
    Device(kind='gpu', index=3)
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from pathlib import Path

from toolkit.errors import ToolkitError
from toolkit.models.specs import check_choice

DEVICES = ("auto", "cpu", "gpu")


@dataclasses.dataclass(frozen=True)
class Device:
    """``kind`` ``cpu`` or ``gpu``; ``index``: the GPU's number among the visible ones."""

    kind: str
    index: int | None = None

    def __str__(self) -> str:
        return "cpu" if self.kind == "cpu" else f"gpu:{self.index}"


def count_gpus(environ: Mapping[str, str] | None = None, dev: str | Path = "/dev") -> int:
    """The NVIDIA GPUs this process may use, counted without starting a framework (JAX must
    be told its devices before its runtime starts): the entries of ``CUDA_VISIBLE_DEVICES``
    when it is set (empty, ``-1`` or ``NoDevFiles``: none), else the ``/dev/nvidiaN`` device
    files the driver made.

        >>> count_gpus({"CUDA_VISIBLE_DEVICES": "2,3"})
        2
        >>> count_gpus({"CUDA_VISIBLE_DEVICES": ""})
        0
    """
    environ = os.environ if environ is None else environ
    shown = environ.get("CUDA_VISIBLE_DEVICES")
    if shown is not None:
        entries = [e.strip() for e in shown.split(",") if e.strip()]
        return 0 if not entries or entries[0] in ("-1", "NoDevFiles") else len(entries)
    try:
        return sum(1 for f in Path(dev).iterdir() if re.fullmatch(r"nvidia\d+", f.name))
    except OSError:
        return 0


def one_gpu_per_task(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the launcher gave each task a GPU of its own (Slurm's ``--gpus-per-task=1`` or
    ``--gpu-bind=single:1``), so a task's one visible GPU is its own."""
    environ = os.environ if environ is None else environ
    return (environ.get("SLURM_GPUS_PER_TASK", "").split(":")[-1] == "1"
            or "single:1" in environ.get("SLURM_GPU_BIND", ""))


def shares_gpus(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ranks may share a node's GPUs (``TOOLKIT_SHARE_GPUS=1``): rank ``r`` then takes
    GPU ``r mod gpus``. Only collectives that go through host memory allow it (a Horovod built
    without NCCL copies GPU tensors to the host); NCCL refuses two ranks on one GPU."""
    value = (os.environ if environ is None else environ).get("TOOLKIT_SHARE_GPUS", "0")
    if value not in ("0", "1"):
        raise ToolkitError(f"TOOLKIT_SHARE_GPUS={value!r} is not 0 or 1",
                           "set TOOLKIT_SHARE_GPUS=1 to let ranks of a node share its GPUs, or "
                           "unset it")
    return value == "1"


def choose_device(requested: str, visible_gpus: int, local_rank: int, local_size: int,
                  environ: Mapping[str, str] | None = None) -> Device:
    """The device of the rank ``local_rank`` of ``local_size`` on its node, which sees
    ``visible_gpus`` GPUs, for the option ``requested``.

    ``cpu``: the CPU. ``auto``: the GPU when the framework sees one, else the CPU. ``gpu``: a
    GPU or a ToolkitError. A rank takes the GPU numbered by its local rank; when each task was
    given one GPU of its own it takes that one. More ranks on a node than GPUs is an error that
    names both numbers (ranks would share a GPU, and NCCL refuses two ranks on one device),
    unless :func:`shares_gpus`.
    """
    check_choice("device", requested, DEVICES)
    if requested == "cpu" or (requested == "auto" and visible_gpus == 0):
        return Device("cpu")
    if visible_gpus == 0:
        shown = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES")
        where = "" if shown is None else f" (CUDA_VISIBLE_DEVICES={shown!r})"
        raise ToolkitError(f"device 'gpu' was asked for, but local rank {local_rank} sees no "
                           f"GPU{where}",
                           "run on a node with GPUs (e.g. sbatch --gres=gpu:N), install the "
                           "framework's CUDA build (tools/install.sh does on a machine with an "
                           "NVIDIA driver), or use --device auto or cpu")
    if visible_gpus == 1 and local_size > 1 and one_gpu_per_task(environ):
        return Device("gpu", 0)
    if local_size > visible_gpus:
        if shares_gpus(environ):
            return Device("gpu", local_rank % visible_gpus)
        raise ToolkitError(
            f"{local_size} ranks run on this node but it has {visible_gpus} visible GPU(s): "
            f"local rank {local_rank} has no GPU of its own",
            f"launch at most {visible_gpus} rank(s) per node (srun --ntasks-per-node="
            f"{visible_gpus}, mpirun -npernode {visible_gpus}), give each task its own GPU "
            f"(srun --gpus-per-task=1), or request {local_size} GPUs per node "
            f"(--gres=gpu:{local_size}); TOOLKIT_SHARE_GPUS=1 lets ranks share GPUs where "
            f"collectives go through host memory (a Horovod built without NCCL)")
    return Device("gpu", local_rank)
