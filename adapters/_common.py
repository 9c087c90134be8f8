"""Small pieces several adapters share (framework-free)."""

from __future__ import annotations

import contextlib
import math
import os
import re
import sys
import tempfile
from collections.abc import Mapping
from typing import Any

from toolkit import SGD, Adam, ToolkitError
from toolkit.errors import describe
from toolkit.models.specs import check_choice


def missing_framework(backend: str, what: str, err: BaseException) -> ToolkitError:
    """The error for a backend whose framework (or Horovod build) is not installed."""
    return ToolkitError(
        f"backend {backend!r} needs {what}, which is not importable here ({err})",
        "run 'tools/install.sh' (it installs the pinned frameworks and builds Horovod with "
        "HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1), or choose another --backend",
    )


def check_world(backend: str, env, size: int, rank: int) -> None:
    """Fails when the framework's communicator disagrees with the launch environment."""
    if (size, rank) == (env.world_size, env.rank):
        return
    if env.launcher == "torchrun":
        raise ToolkitError(
            f"{backend} cannot run under torchrun: Horovod's ranks find each other through "
            f"horovodrun or MPI, so each of the {env.world_size} processes started alone",
            "launch with horovodrun -np N, mpirun -np N or srun -n N --mpi=pmix "
            "(torchrun serves the JAX backends)")
    raise ToolkitError(
        f"{backend}: the communicator has rank {rank} of {size}, but the launcher "
        f"({env.launcher}) started rank {env.rank} of {env.world_size}",
        "launch with horovodrun -np N, mpirun -np N or srun -n N --mpi=pmix",
    )


def step_seed(seed: int, step: int, rank: int) -> int:
    """A 32-bit seed for the randomness (dropout) of one step on one rank.

    Derived from (seed, step, rank) alone, so a resumed run draws exactly what an uninterrupted
    one would have drawn: the checkpoint only needs the step.
    """
    import numpy as np

    return int(np.random.SeedSequence([seed, step, rank]).generate_state(1)[0])


def nonfinite(norm: Any) -> bool:
    """Whether a step is skipped under ``skip_nonfinite``: its gradient norm (any framework's
    scalar; reading it is one device-to-host copy) is not finite. The norm is the same on every
    rank, so every rank decides alike."""
    return norm is not None and not math.isfinite(float(norm))


def float32_matmuls(backend: str, tf32: bool) -> None:
    """How ``backend``'s framework computes float32 matrix products on a GPU: in full float32
    (``tf32=False``), or with TensorFloat-32 (NVIDIA's matrix units; 10 mantissa bits)."""
    if backend == "horovod-torch":
        import torch

        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
    elif backend == "horovod-tf":
        import tensorflow as tf

        tf.config.experimental.enable_tensor_float_32_execution(tf32)
    else:
        import jax

        jax.config.update("jax_default_matmul_precision", "tensorfloat32" if tf32 else "highest")


def loss_name(loss) -> str:
    """``cross_entropy``/``mse`` as given, ``custom`` for a callable; anything else an error."""
    from toolkit.models.specs import LOSSES

    if callable(loss):
        return "custom"
    check_choice("loss", loss, LOSSES)
    return loss


def unique_names(names: list[str]) -> list[str]:
    """``names`` with ``_<k>`` appended to each repeat (the first kept as it is), so every name
    is a distinct checkpoint key.

    Example:
        >>> unique_names(["dense/kernel", "dense/kernel", "dense/bias"])
        ['dense/kernel', 'dense/kernel_1', 'dense/bias']
    """
    seen: set[str] = set()
    out = []
    for name in names:
        new, k = name, 1
        while new in seen:
            new, k = f"{name}_{k}", k + 1
        seen.add(new)
        out.append(new)
    return out


def model_outputs(out: Any) -> Any:
    """The tensor a loss reads of a forward's output ``out``, as Accelerate reads what models
    return: a tensor as it is; a Hugging Face ``ModelOutput`` (or any mapping) by its
    ``logits``; a tuple's or list's first element.

    Example:
        >>> model_outputs(({"logits": 1.0}, "cache")), model_outputs({"logits": 2.0})
        ({'logits': 1.0}, 2.0)
    """
    if isinstance(out, tuple | list):
        if not out:
            raise ToolkitError("the model's forward returned an empty sequence", _OUTPUTS)
        return out[0]
    if isinstance(out, Mapping):  # (a ModelOutput is an OrderedDict with attribute access)
        if "logits" not in out:
            raise ToolkitError(f"the model's forward returned a {type(out).__name__} with keys "
                               f"{sorted(map(str, out))} and no 'logits'", _OUTPUTS)
        return out["logits"]
    return out


_OUTPUTS = ("the loss reads a tensor, a ModelOutput's or mapping's 'logits', or a tuple's first "
            "element: return one of these from forward (docs/bring-your-own.md)")


def check_per_sample(shape: tuple, batch: int, what: str = "the loss function") -> None:
    """A custom loss (or metric) must return one value per sample: shape ``(batch,)``."""
    if tuple(shape) != (batch,):
        raise ToolkitError(
            f"{what} returned shape {tuple(shape)} for a batch of {batch} samples",
            f"return one loss per sample, shape ({batch},): e.g. reduction='none', then a "
            "mean over every axis but the first")


def check_build(accumulation_steps: int, sync_batchnorm: bool) -> None:
    """The build options a pipeline refuses, each with a ToolkitError."""
    if accumulation_steps != 1:
        raise ToolkitError(f"accumulation_steps={accumulation_steps} with a pipeline layout",
                           "the pipeline's micro-batches already split each local batch: "
                           "use accumulation_steps=1 and Pipeline(micro_batches=...)")
    if sync_batchnorm:
        raise ToolkitError("sync_batchnorm is not available with a pipeline layout",
                           "use sync_batchnorm=False (each replica keeps its statistics)")


def check_spec_optimizer(backend: str, layout: str, optimizer: object) -> None:
    """A ToolkitError unless ``optimizer`` is a toolkit spec (where a layout does not yet take
    the framework's own optimizers)."""
    if not isinstance(optimizer, SGD | Adam):
        raise ToolkitError(f"under a {layout} layout {backend} cannot use the optimizer "
                           f"{describe(optimizer)}", "pass toolkit.SGD(...) or toolkit.Adam(...): "
                           "each stage builds it over its own parameters")


@contextlib.contextmanager
def unwrapped_toolkit_errors():
    """Re-raises a ToolkitError raised while tracing a tf.function (autograph wraps it in a
    StagingError whose message is the whole traceback) as itself."""
    try:
        yield
    except ToolkitError:
        raise
    except Exception as err:
        if isinstance(err.__context__, ToolkitError):
            raise err.__context__ from None
        raise


def check_recompute(backend: str, model: object, enabled: bool | None) -> bool | None:
    """``enabled`` (None: the layout's choice), once it is known the model can recompute:
    activation checkpointing is a build option of the toolkit's spec models (each GPT block,
    each hidden MLP layer), so a native model is refused with what to do instead."""
    from toolkit.models.specs import ModelSpec

    if enabled and not isinstance(model, ModelSpec):
        raise ToolkitError(
            f"{backend}: activation_checkpointing applies to the toolkit's spec models; this "
            f"model is a {type(model).__name__}", "recompute inside your own model "
            "(torch.utils.checkpoint, jax.checkpoint / nn.remat, tf.recompute_grad), or train "
            "a toolkit.GPT/MLP/CNN")
    return None if enabled is None else bool(enabled)


# The lines TensorFlow's libraries write while they load, beneath its own log level: absl's
# banner, then informational records ("I0000 00:00:17... port.cc:153] oneDNN custom operations
# are on ..."), once per library that links absl (TensorFlow 2.21 writes two).
_START_LINES = re.compile(r"WARNING: All log messages before absl::InitializeLog\(\) is called"
                          r"|I\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [\w.]+:\d+\] ")


@contextlib.contextmanager
def quiet_start(level_variable: str = "TF_CPP_MIN_LOG_LEVEL"):
    """Runs a framework's import with the informational lines its libraries print as they load
    kept off standard error, unless the user asked for them (``level_variable`` set to 0);
    anything else written meanwhile (a warning, an error) is passed on. The toolkit owns the
    process's output at start: its start-up block comes first."""
    if os.environ.get(level_variable, "2").strip() == "0":
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            lines = caught.read().decode(errors="replace").splitlines(keepends=True)
            kept = "".join(line for line in lines if not _START_LINES.match(line))
            if kept:
                sys.stderr.write(kept)
                sys.stderr.flush()
