"""The ``horovod-torch`` runtime: PyTorch and ``horovod.torch``, started for a layout."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from adapters._horovod.runtime import HorovodRuntime


@dataclasses.dataclass(frozen=True)
class Staged:
    """A batch tensor copied to the GPU on the copy stream; ``ready`` marks the copy's end."""

    tensor: Any
    ready: Any

    def __len__(self) -> int:
        return len(self.tensor)


class TorchRuntime(HorovodRuntime):
    """Horovod's communicator with torch tensors; ``torch``, ``hvd`` and the compute ``dtype``
    are the strategies' after ``setup``."""

    backend = "horovod-torch"
    torch: Any = None
    dtype: Any = None
    dev: Any = None  # the torch.device every tensor of the strategies lives on
    copies: Any = None  # the CUDA stream batches are copied to the GPU on

    def connect(self, env) -> Any:
        try:
            import torch
        except ImportError as err:
            raise self.missing("PyTorch", err) from err
        try:
            import horovod.torch as hvd
        except ImportError as err:
            raise self.missing("Horovod built with PyTorch support", err) from err
        self.torch = torch
        torch.set_num_threads(self.threads(env))
        self.dtype = {"float32": torch.float32, "float64": torch.float64}[self.dtype_name]
        return hvd

    def visible_gpus(self) -> int:
        return self.torch.cuda.device_count() if self.torch.cuda.is_available() else 0

    def use(self, device) -> None:
        if device.kind == "gpu":
            self.torch.cuda.set_device(device.index)
            self.dev = self.torch.device("cuda", device.index)
        else:
            self.dev = self.torch.device("cpu")

    def to_device(self, tensor):
        """``tensor`` on the rank's device (itself when it is there already: on the CPU,
        nothing happens); a host tensor in pinned memory is copied asynchronously."""
        return tensor.to(self.dev, non_blocking=True)

    def device_batch(self, x: np.ndarray, y: np.ndarray) -> tuple[Any, Any]:
        """(``toolkit.contract.PlacesBatches``) On a GPU: the batch copied to it from pinned
        memory on a stream of its own, called in the Trainer's prefetch thread, so the copy
        overlaps the running step (:meth:`arrive` makes the step wait for it). On the CPU: the
        host arrays, untouched."""
        if self.dev.type == "cpu":
            return x, y
        torch = self.torch
        if self.copies is None:
            self.copies = torch.cuda.Stream(self.dev)
        with torch.cuda.stream(self.copies):
            moved = [torch.from_numpy(np.ascontiguousarray(a)).pin_memory()
                     .to(self.dev, non_blocking=True) for a in (x, y)]
            ready = torch.cuda.Event()
            ready.record(self.copies)
        return Staged(moved[0], ready), Staged(moved[1], ready)

    def arrive(self, a) -> Any:
        """A host array, or a :class:`Staged` batch, as a tensor on the rank's device that the
        current stream may use."""
        if isinstance(a, Staged):
            stream = self.torch.cuda.current_stream(self.dev)
            stream.wait_event(a.ready)
            a.tensor.record_stream(stream)  # not reused by the copy stream while the step runs
            return a.tensor
        return self.to_device(self.torch.as_tensor(a))

    def tensor(self, values: np.ndarray) -> Any:
        return self.torch.as_tensor(values)
