"""The ``horovod-tf`` runtime: TensorFlow 2 and ``horovod.tensorflow``, started for a layout."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from adapters._common import quiet_start
from adapters._horovod.runtime import HorovodRuntime
from toolkit import ToolkitError


class TFRuntime(HorovodRuntime):
    """Horovod's communicator with TensorFlow tensors; ``tf``, ``hvd`` and the compute
    ``dtype`` are the strategies' after ``setup``."""

    backend = "horovod-tf"
    tf: Any = None
    dtype: Any = None

    def connect(self, env) -> Any:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        try:
            with quiet_start():
                import tensorflow as tf
        except ImportError as err:
            raise self.missing("TensorFlow", err) from err
        try:
            import horovod.tensorflow as hvd
        except ImportError as err:
            raise self.missing("Horovod built with TensorFlow support", err) from err
        self.tf = tf
        try:  # only possible before TF's runtime starts (once per process)
            tf.config.threading.set_intra_op_parallelism_threads(self.threads(env))
            tf.config.threading.set_inter_op_parallelism_threads(1)
        except RuntimeError:
            pass
        self.dtype = {"float32": tf.float32, "float64": tf.float64}[self.dtype_name]
        return hvd

    def visible_gpus(self) -> int:
        return len(self.tf.config.list_physical_devices("GPU"))

    def use(self, device) -> None:
        """Only the rank's GPU stays visible to TensorFlow, which then places variables and
        compiled steps on it; its memory grows as needed instead of TF taking the whole GPU
        at start (ranks of other jobs may share the node). ``cpu``: no GPU is visible."""
        tf = self.tf
        gpus = tf.config.list_physical_devices("GPU")
        mine = [gpus[device.index]] if device.kind == "gpu" else []
        if not gpus or tf.config.get_visible_devices("GPU") == mine:
            return
        try:  # only possible before TF's runtime starts (once per process)
            tf.config.set_visible_devices(mine, "GPU")
            for gpu in mine:
                tf.config.experimental.set_memory_growth(gpu, True)
        except RuntimeError as err:
            raise ToolkitError(
                f"horovod-tf cannot limit TensorFlow to {device}: TensorFlow started before the "
                f"adapter ({err})", "create the Trainer (or call adapter.setup) before any other "
                "TensorFlow computation, or pass --device to match the devices TF uses") from err

    def tensor(self, values: np.ndarray) -> Any:
        return self.tf.constant(values)

    def barrier(self) -> None:
        self.hvd.allreduce(self.tf.constant(0.0), name="barrier")
