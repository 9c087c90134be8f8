"""Pipeline stages (``toolkit.Pipeline``) for the ``horovod-tf`` backend.

The rounds, messages, gradient reduction, evaluation plumbing, timelines and the full-model
state are the Horovod executors' shared part (``adapters/_horovod/pipeline.py``: one
``hvd.alltoall(tensor, splits=...)`` of ``horovod.tensorflow`` per lockstep round,
``[ndim, *shape, values...]`` messages, replicas' and tied parameters' gradients summed in rank
order). This module is the TensorFlow side: the rounds run eagerly, each piece's forward and
the update are compiled ``tf.function``s. The rounds' alltoalls go, in round order, to an
asynchronous executor of their own (``InOrderRounds``); a stage waiting for a message keeps
its core busy (``Spinner``).

- each rank holds its stage's pieces (``stages.py``: spec models with the data-parallel
  model's names, initialisation and ops; a Keras ``Sequential`` cut by layer index);
- a forward runs the piece under a ``tf.GradientTape`` that is **kept** per (micro-batch,
  chunk) until that micro-batch's backward (the schedule's in-flight activations are really
  held, as ``peak_activations`` counts; ``activation_checkpointing``: a spec's blocks and
  hidden layers only their inputs, ``stages.py``). The backward is
  ``tape.gradient(out, [input] + variables, output_gradients=grad)``: the input's gradient is
  the message back to the previous stage, the variables' are summed over the micro-batches
  once the message is sent (``_defer``: in the stage's next wait);
- the last stage's loss is each micro-batch's mean over its samples divided by ``M`` (the local
  batch's mean, as data parallel's accumulation steps), gathered so every rank of a replica
  returns it;
- the update is ``toolkit.SGD``/``Adam``'s arithmetic on the stage's own variables, the same
  function the data-parallel step applies (``update.apply_update``), with the same host-side
  step count and Adam scalars (``ops.TFState``); or the user's own elementwise Keras optimizer
  over the stage's variables (``keras_optim.py``).

Every schedule of ``toolkit.pipeline_schedule`` runs (gpipe, 1f1b, interleaved-1f1b): the
lockstep rounds carry the chunks. A Keras model's Dropout is re-seeded per step from (seed,
step, rank) as in data parallel.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from adapters._common import check_build, check_recompute, check_spec_optimizer
from adapters._horovod.pipeline import HvdPipeline
from adapters._horovod.rounds import ALIGNMENT, NARROW, aligned_empty
from adapters._update import UpdateRule
from adapters.horovod_tf.in_order import InOrderRounds, Spinner, Submitted
from adapters.horovod_tf.keras_optim import check_elementwise, for_stage
from adapters.horovod_tf.models.keras_native import assign, is_keras_optimizer
from adapters.horovod_tf.ops import TFOps, TFState
from adapters.horovod_tf.precision import TFPrecision
from adapters.horovod_tf.stage_state import stage_state
from adapters.horovod_tf.stages import compiled_pieces, cut_model
from adapters.horovod_tf.update import sum_squares
from toolkit import ToolkitError
from toolkit.contract import StepResult
from toolkit.models.reference import optimizer_slots
from toolkit.parallel.layouts import GATHERS, Pipeline
from toolkit.parallel.pipeline.partition import micro_batch_size
from toolkit.parallel.pipeline.schedules import Action
from toolkit.precision import PRECISIONS


class TFPipeline(HvdPipeline):
    """``toolkit.Pipeline`` for ``horovod-tf`` (see :class:`toolkit.Adapter`): this rank's stage
    of one replica, run by the lockstep rounds of ``adapters/_horovod/pipeline.py``; its
    variables, slots and counters are a ``TFState`` over the stage's variables."""

    recomputes = True  # activation_checkpointing: each piece's blocks (stages.cut_model)
    # mixed: each spec piece on its variables and input cast to the compute dtype (as data
    # parallel), 16-bit activations sent as they are (rounds.pack), fp16's loss scaled on the
    # last stage
    precisions = PRECISIONS
    plugin = TFPrecision  # (adapters/_precision.py)
    backend = "horovod-tf"
    # pipeline x ZeRO: each stage's state sharded over its replicas (stage_state.py)
    composes = ("sharded",)
    part: Any = None  # what the stage holds and how it updates (stage_state.py), at build
    held: dict | None = None  # ZeRO-3: the stage's parameters gathered for this step

    @property
    def shards(self) -> Any:
        """A sharded stage's ``StageShards`` (pipeline x ZeRO), else None."""
        return getattr(self.part, "shards", None)

    @staticmethod
    def check_layout(layout: Pipeline) -> None:
        """Refused before Horovod starts (the grid needs the world size: at ``__init__``)."""
        if layout.dims.gather != GATHERS[0]:
            raise ToolkitError(
                f"horovod-tf gathers a stage's ZeRO-3 parameters once per step, not per "
                f"micro-batch ({layout.name}): TensorFlow's tape keeps what each forward read "
                "until its backward, so per micro-batch it would hold more, not less",
                "drop :gather=micro-batch, or use --backend horovod-torch")

    def __init__(self, runtime, layout: Pipeline, precision: Any = None):
        super().__init__(runtime, layout, precision)
        self.tf, self.hvd, self.dtype = runtime.tf, runtime.hvd, runtime.dtype
        self._rounds: InOrderRounds | None = None  # made at the first round
        # The rounds' alltoalls run on an asynchronous executor of their own: a call enqueues
        # the op and returns; the op runs on the executor's thread while the stage computes
        # on, and reading its output waits for it. (TensorFlow's public API has no executor of
        # its own; tf.data and tf.distribute use this one.)
        from tensorflow.python.eager import context, executor
        self._executor = executor.new_executor(enable_async=True)
        self._executor_scope = context.executor_scope
        self._spinner = Spinner()
        self._split_tensors: dict[tuple[int, ...], Any] = {}  # see _splits

    # ------------------------------------------------------------------------------ build
    def build(self, model: Any, optimizer: Any, loss: Any, *, seed: int = 0,
              accumulation_steps: int = 1, sync_batchnorm: bool = False,
              metrics: Any = None, clip_grad_norm: float | None = None,
              skip_nonfinite: bool = False, activation_checkpointing: bool | None = None) -> None:
        check_build(accumulation_steps, sync_batchnorm)
        recompute = check_recompute("horovod-tf", model, activation_checkpointing)
        if is_keras_optimizer(optimizer):
            import keras

            check_elementwise(keras, optimizer, "pipeline")
            optimizer = for_stage(optimizer)
        else:
            check_spec_optimizer("horovod-tf", "pipeline", optimizer)
        self.ops = TFOps(self.runtime, model, loss, metrics)
        self.metric_names, self.seed = tuple(self.ops.metrics), seed
        self.cut = cut_model(self.tf, model, self.pipe, self.stage, self.runtime, seed,
                             recompute, self.precision.in_compute, self.precision)
        self.keras_model, self.native = self.cut.keras, self.cut.native
        self.rule = UpdateRule(optimizer, clip_grad_norm, skip_nonfinite, self.precision.scaler)
        state = self.state = TFState(self.tf, self.native, self.rule)
        state.vars, state.buffers = self.cut.variables, dict(self.cut.buffers)
        mine = list(state.vars)  # (ZeRO-3 empties it: the shards hold the parameters)
        self.part = stage_state(self.layout)(self, model, optimizer)
        self.slots, self.replicated = _slots(optimizer, state)
        tf, ops, M = self.tf, self.ops, self.pipe.micro_batches
        # each piece's forward compiled, the last piece's ending with its micro-batch's share of
        # the loss (stages.compiled_pieces)
        self.forwards, self.loss_of = compiled_pieces(tf, self.cut, lambda out, y: tf.cast(
            tf.reduce_mean(ops.per_sample_loss(out, y)), self.dtype) / M, self._is_last)
        self._start(mine)

    @property
    def steps(self) -> int:
        return self.state.steps

    @steps.setter
    def steps(self, value: int) -> None:
        self.state.steps = value

    # ------------------------------------------------------------------------------ hooks
    # Asynchronous rounds, submitted in round order. Eager Horovod ops ignore their name and are
    # matched by the order ranks submit them in (measured: two threads' allreduces named "a"
    # and "b", submitted in opposite orders on two ranks, were matched by order), so every
    # rank submits every message round's alltoall in the rounds' order (``InOrderRounds``),
    # whatever order the stage joins them in, to an asynchronous executor that runs them one
    # after the other; the stage computes on meanwhile.
    asynchronous = True

    def _alltoall_start(self, buf: np.ndarray, splits: list[int], name: str) -> Any:
        prefix, _, index = name.rpartition(".")
        if prefix != "pipeline.round":  # not a step's round (evaluation's): at once
            return self._alltoall(buf, splits, name)
        if self._rounds is None:
            self._rounds = InOrderRounds(self._submit, sorted(self.slot))
        return self._rounds.post(int(index), buf, splits, name)

    def _submit(self, buf: np.ndarray, splits: list[int], name: str) -> tuple:
        x, counts = self._tensor(buf), self._splits(splits)
        with self._executor_scope(self._executor):
            return self.hvd.alltoall(x, splits=counts, name=name)

    def _splits(self, splits: list[int]):
        """A step's round's alltoall ``splits`` as an int32 tensor, made once per distinct value
        (``tf.constant`` of the short list took 0.23-0.26 ms per message, S = 2, M = 8)."""
        key = tuple(splits)
        if key not in self._split_tensors:
            self._split_tensors[key] = self.tf.constant(splits, self.tf.int32)
        return self._split_tensors[key]

    def _tensor(self, buf: np.ndarray):
        """``buf`` as a tensor: without a copy (DLPack) when it is aligned, as ``pack``'s
        buffers are (``tf.constant`` took 0.5-0.7 ms per 1 MB message, S = 2, M = 8)."""
        tf = self.tf
        if (buf.size and buf.flags.c_contiguous and buf.flags.writeable
                and buf.ctypes.data % ALIGNMENT == 0):
            if buf.dtype.name == "bfloat16":  # (DLPack has no bfloat16 of numpy's: its bits)
                return tf.bitcast(tf.experimental.dlpack.from_dlpack(
                    buf.view(np.uint16).__dlpack__()), tf.bfloat16)
            return tf.experimental.dlpack.from_dlpack(buf.__dlpack__())
        return tf.constant(buf)

    def _alltoall_wait(self, started: Any) -> tuple[np.ndarray, list[int]]:
        if not isinstance(started, Submitted):
            return started
        if started.outputs is None:
            raise RuntimeError(f"pipeline round {started.index} is awaited before an earlier "
                               "round was posted: the schedule's rounds are out of order")
        got, received = started.outputs
        # Horovod's TensorFlow op blocks its caller, so a stage waiting for a message leaves
        # its core idle, and the message's arrival wakes it late (horovod.torch's wait loops
        # on sched_yield instead). One 1 MB alltoall between two pinned processes, median /
        # 90th percentile of 300: 2.0 / 5-7 ms blocked, 1.65-1.75 / 2.1-2.2 ms with the
        # spinner, horovod.torch 1.85 / 2.3 ms.
        with self._spinner:
            return np.asarray(got), [int(n) for n in np.asarray(received)]

    def _alltoall(self, buf: np.ndarray, splits: list[int],
                  name: str) -> tuple[np.ndarray, list[int]]:
        tf = self.tf
        got, received = self.hvd.alltoall(self._tensor(buf), splits=tf.constant(splits, tf.int32),
                                          name=name)
        return np.asarray(got), [int(n) for n in np.asarray(received)]

    def _allgather(self, flat: np.ndarray, name: str) -> np.ndarray:
        return np.asarray(self.hvd.allgather(self.tf.constant(flat), name=name))  # a view

    def _grouped_sum(self, tensors: list, process_set, name: str) -> list:
        return self.hvd.grouped_allreduce(tensors, op=self.hvd.Sum, name=name,
                                          process_set=process_set)

    def _squares(self, tensors: list):
        return sum_squares(self.tf, tensors) if tensors else self.tf.zeros((), self.dtype)

    def _host(self, tensor) -> np.ndarray:
        return np.asarray(tensor)  # a tensor's: a read-only view, no copy

    def _narrow(self, words: np.ndarray, code: int) -> np.ndarray:
        """A message's 16-bit values (``rounds.unpack``): a view of the float32 words."""
        return np.asarray(words).view(self.tf.bfloat16.as_numpy_dtype
                                      if code == NARROW["bfloat16"] else np.float16)

    def _activation(self, array: np.ndarray, grad: bool):
        """A received message (a read-only view) as a tensor of its own: numpy copies it into
        an aligned buffer that TensorFlow takes as it is, 0.27-0.28 ms per 1 MB message in the
        pipeline against 0.36-0.51 ms for ``tf.constant``. (A tape watches it explicitly.)"""
        own = aligned_empty(array.size, array.dtype).reshape(array.shape)
        np.copyto(own, array)
        return self._tensor(own)

    def _set_buffer(self, buffer, array: np.ndarray) -> None:
        assign(buffer, array)

    # ------------------------------------------------------------------------------ steps
    def _compute(self, action: Action) -> None:
        tf = self.tf
        m, c = action.micro_batch, action.chunk
        key, piece = (m, c), self.cut.pieces[action.chunk]
        first, last = piece.index == 0, self._is_last(c)
        held = () if self.held is None else (self.held,)  # (ZeRO-3's gathered parameters)
        if action.kind == "F":
            inp = self.xs[m] if first else self.inbox_f.pop(key)
            with tf.GradientTape() as tape:
                if not first:
                    tape.watch(inp)
                if held:
                    tape.watch([self.held[n] for n in piece.names])
                out = (self.loss_of[c](inp, self.ys[m], True, *held) if last else
                       self.forwards[c](inp, True, *held))
                loss = out
                if last:  # (fp16: the last stage's loss scaled)
                    out = self.precision.scale_loss(out)
            if last:
                self.loss += float(loss)
            else:
                self.outbox[("SEND_F", m, c)] = out
            self.inputs[key], self.outputs[key] = (tape, inp), out
            self.peak_activations = max(self.peak_activations, len(self.outputs))
            return
        (tape, inp), out = self.inputs.pop(key), self.outputs.pop(key)
        variables = [(self.held or self.state.vars)[n] for n in piece.names]
        sources = variables if first else [inp, *variables]
        grads = tape.gradient(out, sources,
                              output_gradients=None if last else self.inbox_b.pop(key))
        if not first:
            self.outbox[("SEND_B", m, c)] = grads[0]
            grads = grads[1:]
        self._defer(action, (piece.names, grads))

    def _sum(self, gradients) -> None:
        """Adds a backward's parameter gradients to the step's sums, on the device (the first
        micro-batch's gradient kept as it is)."""
        names, grads = gradients
        for n, g in zip(names, grads, strict=True):
            if g is not None:
                g = self.tf.convert_to_tensor(g)
                self.sums[n] = g if n not in self.sums else self.sums[n] + g

    def train_step(self, x: np.ndarray, y: np.ndarray, lr: float | None) -> StepResult:
        """One pipelined step on this replica's local batch; returns the replica's mean loss
        (on every rank of it)."""
        tf, state, M = self.tf, self.state, self.pipe.micro_batches
        scalars = state.scalars(lr, self.dtype)
        micro_batch_size(len(x), M)  # a clear error when M does not divide the local batch
        if self.native:
            self.keras_model.reseed(tf.constant(self.keras_model.seeds(self.seed, self.steps,
                                                                       self.env.rank)))
        xt, yt = self.ops.inputs(x, y)
        self.xs, self.ys = tf.split(xt, M), tf.split(yt, M)
        self.sums: dict[str, Any] = {}  # each gradient summed over the micro-batches
        # (a skipped step keeps the BatchNorm statistics its forward passes moved)
        kept = [(b, tf.identity(b)) for b in state.buffers.values()] if self.rule.skip else []
        self.held = self.part.gather()
        loss = self._run_rounds()
        sums = {n: self.sums[n] if n in self.sums else
                tf.zeros(self.cut.shapes[n], self.dtype) for n in self.mine}
        norm = self.part.update(sums, scalars, kept)
        result = self.rule.result(loss, norm)  # (a skip takes the count back)
        self.steps += 1
        self.xs = self.ys = self.sums = self.held = sums = None
        return result

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> dict[str, float]:
        """Every rank's ``(x, y)`` runs through its replica's pipeline (inputs gathered on the
        first stage, labels on the last); the last stage returns the sums of all of them and
        the other ranks zeros, so the Trainer's sum across ranks is unchanged."""
        ops = self.ops
        xs, ys = self._eval_data(x, y)
        h = ops.inputs(xs, np.zeros(0))[0] if xs is not None else None
        held = self.part.gather()
        extra = () if held is None else (held,)  # (ZeRO-3's parameters for the pieces)
        h = self._through(h, lambda c, h: self.forwards[c](h, False, *extra))
        if not self._is_eval_output():
            return self._empty_sums()
        if len(ys) == 0:
            return {**self._empty_sums(), "count": 0.0}
        return ops.result(ops.eval_sums(h, ops.inputs(np.zeros(0), ys)[1]), len(ys))

    # ------------------------------------------------------------------------------ state
    def _local(self) -> dict[str, np.ndarray]:
        """This rank's tensors under their neutral keys (each stage's, on every replica;
        sharded: gathered over the stage's replicas)."""
        return self.part.local()

    def _replicated(self) -> dict[str, np.ndarray]:
        return {k: v for k, v in self.state.state().items() if k in self.replicated}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """Keeps this stage's part of the full ``state``."""
        self.state.load(state)
        self.part.load(state)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank (its stage) holds: its parameters, a gradient of each, their
        optimizer slots (sharded: what its shards hold)."""
        return self.part.memory_bytes()


def _slots(optimizer: Any, state: TFState) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(slots, replicated)``: the per-parameter slot names (``opt/<slot>/<param>``), and the
    keys that are the same on every rank (not gathered): the counters, and a Keras optimizer's
    own scalars (``opt/iteration``, ...)."""
    replicated = ("opt/count", "rng/step")
    if state.keras_opt is None:
        return optimizer_slots(optimizer), replicated
    slots: dict[str, None] = {}
    for key in state.slots:
        slot, _, param = key[len("opt/"):].partition("/")
        if param in state.vars:
            slots[slot] = None
        else:
            replicated += (key,)
    return tuple(slots), replicated
