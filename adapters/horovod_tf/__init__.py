"""The ``horovod-tf`` backend: TensorFlow 2 with Horovod's core TensorFlow ops.

Built on ``horovod.tensorflow`` (allreduce/broadcast ops) and ``tf.GradientTape``, not on
``horovod.tensorflow.keras``, which targets Keras 2 and breaks with Keras 3. ``runtime.py``
starts Horovod; ``ops.py`` holds what every layout shares (inputs, losses, evaluation sums, the
variables and optimizer slots and their state); one strategy per layout: ``data_parallel.py``,
``sharded.py`` (ZeRO 1-3 / FSDP over flat shards, ``flat_shards.py``), ``pipeline.py`` (stages
cut by ``stages.py``). ``models/`` has the spec models' forward passes and native Keras models.
Importing this package imports no framework.
"""

from adapters._backend import Backend

_HERE = "adapters.horovod_tf"


class HorovodTFAdapter(Backend):
    """TensorFlow + Horovod. See :class:`toolkit.Adapter` for the contract."""

    name = "horovod-tf"
    runtime_class = f"{_HERE}.runtime:TFRuntime"
    strategies = {
        "data_parallel": f"{_HERE}.data_parallel:TFDataParallel",
        "sharded": f"{_HERE}.sharded:TFSharded",
        "pipeline": f"{_HERE}.pipeline:TFPipeline",
    }
