"""The ``horovod-torch`` runtime: PyTorch and ``horovod.torch``, started for a layout."""

from __future__ import annotations

from typing import Any

import numpy as np

from adapters._horovod.runtime import HorovodRuntime


class TorchRuntime(HorovodRuntime):
    """Horovod's communicator with torch tensors; ``torch``, ``hvd`` and the compute ``dtype``
    are the strategies' after ``setup``."""

    backend = "horovod-torch"
    torch: Any = None
    dtype: Any = None

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
        return self.torch.cuda.device_count()

    def tensor(self, values: np.ndarray) -> Any:
        return self.torch.as_tensor(values)
