"""How the Horovod adapters start Horovod for a layout, and wire a pipeline's executor in.

A ``toolkit.Pipeline`` averages gradients in Horovod process sets (each stage's replicas, the
end stages holding a tied embedding: ``toolkit.PipelineGrid.reduction_groups``). Horovod's
static sets must be given to the first ``hvd.init``, so the Trainer calls ``set_layout`` before
``setup``, and ``setup`` initialises Horovod through ``init_horovod``.
"""

from __future__ import annotations

import importlib
from typing import Any

from adapters._horovod.runtime import init_horovod
from toolkit._layouts import Pipeline


class HvdPipelineAbility:
    """The pipeline wiring of a Horovod adapter (a mixin): ``set_layout`` keeps a
    ``toolkit.Pipeline`` (its process sets must be registered at ``hvd.init``, which the
    adapter's ``setup`` calls through ``_init_horovod``) and the executor (``executor`` names
    its class as ``"module:Class"``) is made once Horovod runs, before or after ``setup``."""

    pipeline = None  # the executor, under a toolkit.Pipeline
    pipeline_layout = None
    process_sets: dict = {}
    executor = ""

    def _set_pipeline(self, layout: Any) -> bool:
        """Whether ``layout`` is a pipeline (kept, and its executor made if set up)."""
        if not isinstance(layout, Pipeline):
            return False
        self.pipeline_layout = layout
        if getattr(self, "hvd", None) is not None:  # setup ran first
            self._make_pipeline()
        return True

    def _init_horovod(self, hvd, env) -> None:
        """``hvd.init`` with the layout's process sets, then the executor if ``set_layout``
        came first (call from ``setup`` once ``hvd`` and ``env`` are set)."""
        self.process_sets = init_horovod(hvd, self.pipeline_layout, env.world_size)
        if self.pipeline is None:
            self._make_pipeline()

    def _make_pipeline(self) -> None:
        if self.pipeline_layout is not None:
            module, cls = self.executor.split(":")
            self.pipeline = getattr(importlib.import_module(module), cls)(
                self, self.pipeline_layout)

    def pipeline_position(self) -> tuple[int, int]:
        """This rank's ``(stage, replica)`` (``(0, rank)`` without a pipeline layout)."""
        return self.pipeline.position if self.pipeline is not None else (0, self.env.rank)
