"""The horovod-tf pipeline's message rounds on an asynchronous TensorFlow executor
(``pipeline.TFPipeline``): each round's alltoall submitted in the step's round order whatever
order the stage posts them in, and a spinner that keeps the core busy while a stage waits."""

from __future__ import annotations

import os
import threading

import numpy as np


class InOrderRounds:
    """Submits each message round's alltoall (``submit(buf, splits, name)``, which enqueues it
    on an asynchronous TensorFlow executor and returns its output tensors at once) in the
    order ``order`` (the message rounds of a step, repeated every step), whatever order the
    stage posts them in: a round posted early waits here until every round before it has been
    posted. :meth:`post` returns the round's ``Submitted``."""

    def __init__(self, submit, order: list[int]):
        self.submit, self.order = submit, order
        self.posted: dict[int, tuple] = {}
        self.next = 0  # the position in ``order`` of the next round to submit

    def post(self, index: int, buf: np.ndarray, splits: list[int], name: str) -> Submitted:
        submitted = Submitted(index)
        self.posted[index] = (buf, splits, name, submitted)
        while self.order[self.next] in self.posted:
            buf, splits, name, ready = self.posted.pop(self.order[self.next])
            ready.outputs = self.submit(buf, splits, name)
            self.next = (self.next + 1) % len(self.order)
        return submitted


class Spinner:
    """A daemon thread that keeps this process's core busy (``os.sched_yield`` in a loop)
    while the context is entered, so that a blocked wait does not leave the core idle."""

    def __init__(self):
        self.on = threading.Event()
        threading.Thread(target=self._run, daemon=True, name="toolkit-pipeline-spin").start()

    def _run(self) -> None:
        while True:
            self.on.wait()
            while self.on.is_set():
                os.sched_yield()

    def __enter__(self) -> None:
        self.on.set()

    def __exit__(self, *exc) -> None:
        self.on.clear()


class Submitted:
    """A round posted to ``InOrderRounds``: its alltoall's output tensors once submitted."""

    def __init__(self, index: int):
        self.index, self.outputs = index, None
