"""The Trainer: the one training loop every backend shares."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from toolkit.checkpoint.resume import describe as _describe
from toolkit.checkpoint.settings import run_settings
from toolkit.contract import Adapter, DrivesDevices, PlacesBatches, StepResult
from toolkit.data.dataset import Dataset, as_dataset
from toolkit.data.prefetch import BatchPrefetcher, check_prefetch, prefetches
from toolkit.data.sampler import GlobalBatchSampler
from toolkit.errors import ToolkitError, at_least_one
from toolkit.launch.devices import DEVICES
from toolkit.launch.env import LaunchEnv
from toolkit.launch.rank0 import current_env, print0
from toolkit.launch.stall import DEFAULT_STALL_TIMEOUT, StallWatch, check_timeout, open_watch
from toolkit.models.flops import check_flops
from toolkit.models.reference import check_clip
from toolkit.models.specs import LOSSES, OptimizerSpec, check_choice, learning_rate, lr_scale
from toolkit.parallel.layouts import resolve_layout
from toolkit.precision import use_precision
from toolkit.trainer.checkpoints import RunCheckpoints
from toolkit.trainer.evaluation import check_metrics, evaluate
from toolkit.trainer.guard import DivergenceGuard
from toolkit.trainer.history import History, MetricsLog, ProgressLine, epoch_line, eval_line
from toolkit.trainer.losses import StepLosses, report
from toolkit.trainer.metrics import IntervalMeter, interval_line, native_lr, tokens_per_sample
from toolkit.trainer.preemption import (
    PREEMPTED_EXIT_CODE,
    StopAgreement,
    TrainingPreempted,
    check_signals,
    noting_signals,
)
from toolkit.trainer.stopping import StopsTogether
from toolkit.trainer.summary import format_facts, run_facts
from toolkit.trainer.tensorboard import TensorBoardLog, check_tensorboard_dir

__all__ = ["PREEMPTED_EXIT_CODE", "History", "Trainer", "TrainingPreempted"]


class Trainer(StopsTogether):
    """The one training loop of every backend and layout: a :class:`GlobalBatchSampler`
    splits each global batch, the adapter's strategy for the layout steps, step losses are
    averaged across ranks before anyone prints them, and only global rank 0 prints and writes.

    Args:
        adapter: a backend, from ``adapters.get(name)``.
        model: a model spec (``toolkit.MLP``) or the backend's native model.
        optimizer: an optimizer spec (``toolkit.SGD``/``toolkit.Adam``) or a native one.
        loss: ``cross_entropy`` (integer labels; for outputs with a sequence axis, the mean
            over tokens), ``mse``, or a callable in the backend's framework,
            ``loss(outputs, labels) -> per-sample losses`` of shape ``(batch,)``; the Trainer
            averages them over the batch and across ranks exactly as the built-in losses.
        layout: ``toolkit.DataParallel()`` (the default), ``toolkit.Sharded(stage=1|2|3)``
            (ZeRO/FSDP), ``toolkit.Pipeline`` or their text forms (``"sharded:3"``).
        metrics: evaluation metrics, ``name -> fn(outputs, labels) -> per-sample values`` in
            the backend's framework; evaluation reports ``val_<name>``, the mean over every
            sample (summed per rank, added across ranks: exact at any world size).
        sync_batchnorm: BatchNorm statistics over the global batch (jax-pjit always; jax-pmap
            averages them every step); without it each rank normalises with its own samples'
            and rank 0's running statistics are evaluated and checkpointed.
        global_batch_size: samples per step over all ranks; the world size must divide it.
        epochs, max_steps: passes over the training data, or this many global steps instead.
        seed: seeds the model initialisation and the sampler's shuffling.
        shuffle, drop_last: see :class:`GlobalBatchSampler`.
        lr_scaling: ``none``, ``linear`` or ``sqrt`` multiplies the learning rate by 1, N or
            sqrt(N) for N ranks (for weak scaling, where the global batch grows with N).
        accumulation_steps: split each local batch into this many micro-batches and sum their
            gradients before the one allreduce of the step (same result, less memory).
        device: ``auto`` (a GPU when the framework sees one, else the CPU), ``cpu`` or ``gpu``;
            each rank takes the GPU of its local rank (``toolkit.launch.devices``).
        clip_grad_norm: scale each step's averaged gradient by ``clip / max(norm, clip)``, its
            norm over the whole model (every shard, stage and split part once); the norm before
            clipping goes to the metrics log (``grad_norm``) and the interval line.
        precision: a ``toolkit.precision`` policy (``"32"``, ``"bf16-mixed"``, ...); None:
            the adapter's. init_scale, growth_interval: ``"fp16-mixed"``'s dynamic loss
            scale, its first value (a power of two; default 65536) and the clean steps after
            which it doubles (default 2000), as torch's ``GradScaler`` takes them; recorded
            with the run's settings, so a resume with others needs ``allow_changes``.
            activation_checkpointing: each block (hidden layer) recomputes its
            activations in the backward pass (True) or nothing does (False); None: the layout's
            choice, False but in horovod-tf's ZeRO-3, which recomputes (docs/memory.md).
        checkpoint_dir: where checkpoints go (shared storage for multi-node jobs);
            checkpoint_every: every this many steps (and at the end), checkpoint_every_seconds:
            or seconds of training; keep: how many to keep.
        resume: ``"latest"`` (the newest checkpoint in ``checkpoint_dir``; an error if none),
            ``"auto"`` (the newest, else a new run: for requeued jobs) or a checkpoint's path.
        async_checkpoint: write checkpoints in a background thread.
        allow_changes: resume even when the settings that define the trajectory (model,
            optimizer and schedule, global batch, seed, shuffling, lr scaling) differ from the
            checkpoint's (printed and recorded); without it such a resume stops with the list.
        metrics_log: a JSON-lines file rank 0 appends step, interval, eval and epoch records to
            (docs/metrics.md). tensorboard_dir: rank 0 writes TensorBoard event files there.
        log_every: also print a line every this many steps (0: once per epoch).
        eval_every: evaluate the ``validation`` data of :meth:`fit` every this many steps as
            well (None: at each epoch's end only). A run that stops between epochs' ends
            (``max_steps``) is evaluated at its last step too.
        peak_flops, flops_per_sample: the MFU's peak FLOP/s of one device (default: the table
            of known GPUs) and training FLOPs of one sample (default: the spec model's).
        progress: show a progress bar on rank 0 when stderr is a terminal.
        stop_signals: with a checkpoint directory, these signals (Slurm's ``--signal``, a time
            limit, Ctrl-C) make every rank finish its step, write a checkpoint and raise
            :class:`TrainingPreempted`. Pass ``()`` to install none.
        stop_check_every: ranks agree on stopping (a signal may reach ranks at different
            steps) and average their step losses every this many steps, one tiny allreduce
            each, so a job stops within that many steps of a signal or a diverged loss.
        divergence_factor, divergence_window: a non-finite step loss always stops the run
            (:class:`toolkit.trainer.guard.TrainingDiverged`, exit status 3 under
            ``toolkit.run``) before any checkpoint is written from that state; with a factor,
            so does a loss above ``factor`` x its best for ``divergence_window`` steps.
        on_nonfinite, max_consecutive_skips: ``"skip"``: a step whose gradient norm (over the
            whole model, the same on every rank) is not finite updates nothing (parameters,
            optimizer state and count, BatchNorm statistics) and the sampler moves on; more
            than ``max_consecutive_skips`` such steps in a row stop the run as above.
        stall_timeout: seconds a rank may be silent or in one phase (step, checkpoint, eval)
            before the job ends naming it (``toolkit.launch.stall``, status 124); 0: never.
        prefetch: ``True`` loads the next local batch in a background thread during the step,
            ``False`` when its step starts, ``"auto"`` the thread unless the data are numpy
            arrays in memory; ``trainer.prefetch_stats`` says how much loading time it hid.
        eval_batch_size: samples per ``adapter.evaluate`` call per rank. env: detected if None.
    """

    def __init__(
        self,
        adapter: Adapter,
        model: Any,
        optimizer: OptimizerSpec | Any,
        *,
        loss: Any = "cross_entropy",
        sync_batchnorm: bool = False,
        metrics: dict[str, Any] | None = None,
        layout: Any = None,
        global_batch_size: int,
        epochs: int = 1,
        max_steps: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
        lr_scaling: str = "none",
        accumulation_steps: int = 1,
        clip_grad_norm: float | None = None,
        precision: str | None = None,
        init_scale: float | None = None,
        growth_interval: int | None = None,
        activation_checkpointing: bool | None = None,
        device: str = "auto",
        checkpoint_dir: str | os.PathLike | None = None,
        checkpoint_every: int | None = None,
        checkpoint_every_seconds: float | None = None,
        keep: int = 3,
        resume: str | os.PathLike | None = None,
        async_checkpoint: bool = False,
        allow_changes: bool = False,
        metrics_log: str | os.PathLike | None = None,
        tensorboard_dir: str | os.PathLike | None = None,
        log_every: int = 0,
        eval_every: int | None = None,
        peak_flops: float | None = None,
        flops_per_sample: float | None = None,
        progress: bool = True,
        stop_signals: tuple[str, ...] = ("SIGUSR1", "SIGTERM", "SIGINT"),
        stop_check_every: int = 10,
        divergence_factor: float | None = None,
        divergence_window: int = 20,
        on_nonfinite: str = "stop",
        max_consecutive_skips: int = 5,
        stall_timeout: float = DEFAULT_STALL_TIMEOUT,
        prefetch: bool | str = "auto",
        eval_batch_size: int = 1024,
        env: LaunchEnv | None = None,
    ):
        if not callable(loss):
            check_choice("loss", loss, LOSSES)
        if not isinstance(adapter, Adapter):
            raise ToolkitError(f"{adapter!r} is not a backend adapter",
                               "pass adapters.get('horovod-torch') (or another backend name)")
        at_least_one("accumulation_steps", accumulation_steps, "use 1 for no gradient accumulation")
        self.checkpoints = RunCheckpoints(
            checkpoint_dir, every=checkpoint_every, every_seconds=checkpoint_every_seconds,
            keep=keep, resume=resume, async_write=async_checkpoint, allow_changes=allow_changes)
        self.adapter = adapter
        self.model, self.optimizer, self.loss = model, optimizer, loss
        self.sync_batchnorm, self.device = sync_batchnorm, check_choice("device", device, DEVICES)
        self.metrics = check_metrics(metrics, builtin_accuracy=loss == "cross_entropy")
        self.layout = resolve_layout(layout, adapter)
        self.global_batch_size = global_batch_size
        self.epochs, self.max_steps = epochs, max_steps
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.lr_scaling, self.accumulation_steps = lr_scaling, accumulation_steps
        self.clip_grad_norm = check_clip(clip_grad_norm)
        self.precision = use_precision(adapter, precision)
        if init_scale is not None or growth_interval is not None:
            self.precision = use_precision(
                adapter, self.precision.with_scaling(init_scale, growth_interval))
        self.activation_checkpointing = activation_checkpointing  # (None: the layout's)
        self.metrics_log = Path(metrics_log) if metrics_log else None
        self.log_every, self.progress = log_every, progress
        if eval_every is not None:
            at_least_one("eval_every", eval_every, "or None: at each epoch's end only")
        self.eval_every = eval_every
        self.peak_flops, self.flops_per_sample = (check_flops(k, v) for k, v in (
            ("peak_flops", peak_flops), ("flops_per_sample", flops_per_sample)))
        self.tensorboard_dir = check_tensorboard_dir(tensorboard_dir)
        check_signals(stop_signals)
        at_least_one("stop_check_every", stop_check_every, "use 1 to agree after every step")
        at_least_one("eval_batch_size", eval_batch_size,
                     "the default of 1024 samples per call suits most models")
        self.stop_signals = tuple(stop_signals) if checkpoint_dir is not None else ()
        self._stop = StopAgreement(stop_check_every, self.stop_signals)
        self.skip_nonfinite = check_choice("on_nonfinite", on_nonfinite, ("stop", "skip")) == "skip"
        self._guard = DivergenceGuard(divergence_factor, divergence_window, max_consecutive_skips)
        self.prefetch, self.eval_batch_size = check_prefetch(prefetch), eval_batch_size
        self.prefetch_stats: dict[str, Any] | None = None  # of the latest fit
        self._train_data: Dataset | None = None  # its fingerprint, if any, is checkpointed
        self.env = env or current_env()
        self._log = MetricsLog(self.metrics_log, self.env.rank)
        self._tb = TensorBoardLog(self.tensorboard_dir, self.env.rank)
        self.stall_timeout = check_timeout(stall_timeout)
        self._watch = StallWatch(self.env.rank, self.env.world_size, 0)  # (until set-up)
        lr_scale(lr_scaling, 1)  # validates the name before any process group exists
        self.global_step = 0
        self._setup_done = False

    _spec_optimizer = property(lambda self: isinstance(self.optimizer, OptimizerSpec))
    store = property(lambda self: self.checkpoints.store,
                     doc="The run's :class:`toolkit.CheckpointStore` (None without checkpoints)")

    # ------------------------------------------------------------------------ set-up
    def _setup(self, num_samples: int) -> None:
        env = self.env
        # (custom adapters need not know the option while it is the default)
        self.adapter.setup(env, self.layout, **({} if self.device == "auto"
                                                 else {"device": self.device}))
        self._watch = open_watch(env, self.stall_timeout, lambda v: self.adapter.allreduce(
            v, "sum"), lambda record: self._log.write([{**record, "step": self.global_step}]))
        # The layout says which share of each global batch this process loads: its own under
        # data parallelism, its replica's under a pipeline or a tensor-parallel group that
        # spans processes (those processes compute one replica and must see the same samples).
        drives = isinstance(self.adapter, DrivesDevices)  # (several devices per process)
        share = self.layout.data_share(env.world_size, env.rank,
                                       self.adapter.local_device_count() if drives else 1)
        self.sampler = GlobalBatchSampler(
            num_samples, self.global_batch_size, world_size=share.count, rank=share.index,
            shuffle=self.shuffle, seed=self.seed, drop_last=self.drop_last)
        self.layout.micro_batch(self.sampler.local_batch_size)  # its error when they do not fit
        self.sampler.check_accumulation(self.accumulation_steps)
        # (options at their defaults are not passed: an adapter of one's own need not know them)
        options = {"clip_grad_norm": self.clip_grad_norm,
                   "skip_nonfinite": self.skip_nonfinite or None,
                   "activation_checkpointing": self.activation_checkpointing}
        self.adapter.build(self.model, self.optimizer, self.loss, seed=self.seed,
                           accumulation_steps=self.accumulation_steps,
                           sync_batchnorm=self.sync_batchnorm, metrics=self.metrics,
                           **{k: v for k, v in options.items() if v is not None})
        self.checkpoints.open(self.adapter, self.sampler, env, self.layout, self._describe_run)
        ckpt = self.checkpoints.restore(self._log.write)
        if ckpt is not None:
            self.global_step = ckpt.step
            self._guard.load_state_dict(ckpt.meta.get("guard"))
        self._setup_done = True

    def _describe_run(self) -> dict:
        """What a checkpoint records besides the tensors and the sampler's position; its
        ``settings`` are compared on resume."""
        model, optimizer = _describe(self.model), _describe(self.optimizer)
        return {
            "rng": {"seed": self.seed},  # all randomness (init, shuffling) derives from it
            "guard": self._guard.state_dict(),  # a resumed run stops where this one would
            "model": model, "optimizer": optimizer,
            # resuming on other data fails (asked late: computing one may read a corpus)
            "data_fingerprint": getattr(self._train_data, "fingerprint", None),
            "settings": run_settings(
                model=model, optimizer=optimizer, global_batch_size=self.global_batch_size,
                seed=self.seed, shuffle=self.shuffle, drop_last=self.drop_last,
                lr_scaling=self.lr_scaling, backend=self.adapter.name, layout=self.layout.name,
                world_size=self.env.world_size, clip_grad_norm=self.clip_grad_norm,
                loss_scaling=self.precision.scaling_settings()),
        }

    def _say_what_runs(self, samples: int) -> None:
        """The start-up block on rank 0, and the metrics log's first record."""
        facts = self._facts = run_facts(self, samples)
        print0(format_facts(facts), env=self.env)
        self._log.write([{"event": "start", **facts}])

    # ------------------------------------------------------------------------ the loop
    def fit(self, data: Dataset | np.ndarray, y: np.ndarray | None = None,
            validation: Dataset | tuple[np.ndarray, np.ndarray] | None = None) -> History:
        """Trains on ``data`` (inputs ``x`` with labels ``y``, or a :class:`toolkit.Dataset`
        such as :class:`toolkit.TokenWindows`); evaluates on ``validation`` (``(x_val, y_val)``
        or a data set) after each epoch, every ``eval_every`` steps, and at the last step
        (``History.evaluations``).
        Every rank passes the whole data set; the sampler
        picks each rank's samples, which the data set loads (see ``prefetch``)."""
        train = as_dataset(data, y, what="the training data")
        if validation is not None:
            validation = as_dataset(validation, what="the validation data")
        self._train_data = train
        if not self._setup_done:
            self._setup(len(train))
            self._say_what_runs(len(train))
        env, sampler = self.env, self.sampler
        total = self.max_steps if self.max_steps is not None else self.epochs * len(sampler)
        self._history = History(first_step=self.global_step, world_size=env.world_size)
        self._losses = StepLosses(self._history, self._guard, self._log, IntervalMeter(
            env.world_size, self.global_batch_size, tokens_per_sample(self.model, train),
            self._facts["flops_per_sample"], self._facts["peak_flops"]), self._tb)
        self._progress = ProgressLine(self.progress and env.rank == 0, self.max_steps,
                                      self.global_batch_size)
        place = self.adapter.device_batch if isinstance(self.adapter, PlacesBatches) else None
        loader = BatchPrefetcher(train, sampler, max(0, total - self.global_step),
                                 prefetch=prefetches(train, self.prefetch), place=place)
        try:
            with loader, noting_signals(self.stop_signals, self._stop.note):
                self._loop(loader, validation, total,
                           lr_scale(self.lr_scaling, sampler.world_size))
        finally:  # the thread is joined by now, whatever happened
            self.prefetch_stats = loader.stats()
        self._log.write([{"event": "prefetch", **self.prefetch_stats}])
        if self.checkpoints.unsaved(self.global_step):
            self.save_checkpoint()
        self.checkpoints.wait()
        self._watch.at("idle", self.global_step)
        return self._history

    def save_checkpoint(self) -> Path | None:
        """Writes the current state (rank 0 writes replicated state; returns its path there).
        The steps since the last check pass the divergence guard first."""
        if self.checkpoints.store is not None and len(getattr(self, "_losses", ())):
            self._flush()  # raises TrainingDiverged before a diverged state is saved
        with self._watch.during("checkpoint", self.global_step):
            return self.checkpoints.save(self.global_step)

    def _flush(self) -> None:
        """Averages the pending step losses across ranks (one allreduce), logs them, and
        stops every rank together when the guard finds one diverged."""
        diverged = self._losses.flush(
            self.global_step, self.adapter.allreduce if self.env.is_distributed else None)
        if diverged is not None:
            self._stop_diverged(*diverged)

    def _loop(self, loader: BatchPrefetcher, validation, total: int, scale: float) -> None:
        env, sampler, history, progress = self.env, self.sampler, self._history, self._progress
        self.checkpoints.start_clock()
        evaluated = -1  # the step last evaluated (each step's evaluation: once)
        while self.global_step < total:
            epoch, epoch_start = sampler.epoch, time.monotonic()
            first_in_epoch = len(history.losses) + len(self._losses)
            for idx in sampler:
                lr = learning_rate(self.optimizer, self.global_step) * scale \
                    if self._spec_optimizer else None
                self._watch.at("input", self.global_step + 1)
                batch = self._losses.meter.load(loader, idx)
                self._watch.at("step", self.global_step + 1)
                # a native optimizer's lr is read before its step: the value the step uses
                # (its scheduler moves it after the step)
                used = lr if self._spec_optimizer else native_lr(self.optimizer)
                step = StepResult.of(self.adapter.train_step(*batch, lr))
                self._losses.add(step, self.skip_nonfinite, used)  # (norm: the same everywhere)
                self.global_step += 1
                done = sampler.step if sampler.epoch == epoch else len(sampler)  # at its end
                progress.update(self.global_step, epoch, done, len(sampler), step.loss)
                if self.log_every and self.global_step % self.log_every == 0:
                    self._flush()
                    progress.clear()  # (the line is not printed over the bar)
                    print0(interval_line(self._losses.last_interval, history.losses[-1]), env=env)
                elif self.global_step % self._stop.check_every == 0:
                    self._flush()  # the guard sees every loss within stop_check_every steps
                if self.checkpoints.due(self.global_step) and self._loss_settled():
                    self.save_checkpoint()
                if (validation is not None and self.eval_every and sampler.epoch == epoch
                        and self.global_step % self.eval_every == 0):  # (an epoch's end: below)
                    self._evaluate_at_step(validation)
                    evaluated = self.global_step
                if self.stop_signals and self._stop.agreed(self.global_step, self.adapter,
                                                           env.is_distributed):
                    self._stop_preempted(loader)
                if self.global_step >= total:
                    break
            self._flush()
            progress.clear()
            if sampler.step == 0:  # the epoch ran to its end
                record = self._end_epoch(epoch, history.losses[first_in_epoch:], validation,
                                         time.monotonic() - epoch_start)
                history.epochs.append(record)
                evaluated = self.global_step
        if validation is not None and evaluated != self.global_step:
            self._evaluate_at_step(validation)  # the model fit returns, between epochs' ends

    def _evaluate_at_step(self, validation) -> None:
        """An evaluation between epochs' ends: its eval record, and rank 0's line."""
        self._flush()  # (the line shows this step's training loss)
        self._progress.clear()
        result = self.evaluate(validation)
        self._history.evaluations.append({"step": self.global_step, **result})
        print0(eval_line(self.global_step, self._history.final_loss, result), env=self.env)

    def _loss_settled(self) -> bool:
        """False while the loss is above ``divergence_factor`` x its best: a scheduled
        checkpoint waits, so that the newest one predates a divergence found later."""
        self._flush()
        return not self._guard.above

    def _end_epoch(self, epoch: int, losses: list[float], validation, seconds: float) -> dict:
        record: dict[str, float] = {"epoch": epoch, "step": self.global_step,
                                    "loss": float(np.mean(losses)) if losses else math.nan,
                                    "seconds": round(seconds, 4)}
        if validation is not None:
            result = self.evaluate(validation)
            record.update(result)
            self._history.evaluations.append({"step": self.global_step, **result})
        print0(epoch_line(record, seconds), env=self.env)
        self._log.write([{"event": "epoch", **record}])
        return record

    def evaluate(self, data: Dataset | np.ndarray, y: np.ndarray | None = None, *,
                 log: bool = True) -> dict[str, float]:
        """Loss (and accuracy for classification) over all of ``data`` (``x`` with labels
        ``y``, or a data set), exactly as one process evaluating everything would; ``log``: as an
        eval record (False: a part of a larger evaluation that :meth:`log_record` records)."""
        with self._watch.during("evaluation", self.global_step):
            result = evaluate(self.adapter, self.env, self.layout, as_dataset(
                data, y, what="the evaluation data"), self.eval_batch_size, self.metrics,
                with_accuracy=self.loss == "cross_entropy")
        if log:
            self.log_record({"event": "eval", "step": self.global_step, **result})
        return result

    def log_record(self, record: dict) -> None:
        """``record`` (an ``event``, a ``step``, ...) to the metrics log and TensorBoard."""
        report(self._log, self._tb, [record])
