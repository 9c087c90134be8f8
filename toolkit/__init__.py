"""hpc-trainer-toolkit: one Trainer, four backends, one sampler, one checkpoint format.

This package is framework-free: importing it imports numpy and the standard library only.
Backends live in the ``adapters`` package and import their framework when chosen.
"""

from toolkit.checkpoint.store import Checkpoint, CheckpointError, CheckpointStore, read_checkpoint
from toolkit.contract import Adapter, ShardedAdapter, StepResult
from toolkit.data.dataset import ArrayDataset, Dataset, TokenWindows
from toolkit.data.sampler import GlobalBatchSampler, shard_indices
from toolkit.errors import ToolkitError
from toolkit.launch.cli import ArgumentParser, UsageError, run
from toolkit.launch.env import LaunchEnv, detect_launch_env, expand_nodelist
from toolkit.launch.options import add_trainer_options, trainer_options
from toolkit.launch.rank0 import atomic_open, current_env, print0, save0
from toolkit.models.gpt import GPT
from toolkit.models.specs import CNN, MLP, SGD, Adam, WarmupCosine, learning_rate, lr_scale
from toolkit.parallel.layouts import DataParallel, ParallelDims, Pipeline, Sharded, parse_layout
from toolkit.parallel.pipeline.partition import (
    ModelPartition,
    PipelineGrid,
    micro_batch_size,
    partition_layers,
    partition_model,
)
from toolkit.parallel.pipeline.schedules import Action, Schedule, bubble_formula, pipeline_schedule
from toolkit.parallel.pipeline.simulation import (
    LockstepRound,
    Simulation,
    lockstep_idle_fraction,
    lockstep_rounds,
    simulate_schedule,
    validate_schedule,
)
from toolkit.parallel.pipeline.timeline import StageRecorder, read_timeline
from toolkit.trainer.guard import DIVERGED_EXIT_CODE, TrainingDiverged
from toolkit.trainer.trainer import PREEMPTED_EXIT_CODE, History, Trainer, TrainingPreempted

__all__ = [
    "Action", "Adam", "Adapter", "ArgumentParser", "ArrayDataset", "CNN", "Checkpoint",
    "CheckpointError", "CheckpointStore", "DIVERGED_EXIT_CODE", "DataParallel", "Dataset", "GPT",
    "GlobalBatchSampler", "History", "LaunchEnv", "LockstepRound", "MLP", "ModelPartition",
    "PREEMPTED_EXIT_CODE", "ParallelDims", "Pipeline", "PipelineGrid", "SGD", "Schedule", "Sharded",
    "ShardedAdapter", "Simulation", "StageRecorder", "StepResult", "TokenWindows", "ToolkitError",
    "Trainer",
    "TrainingDiverged", "TrainingPreempted", "UsageError", "WarmupCosine", "add_trainer_options",
    "atomic_open",
    "bubble_formula", "current_env", "detect_launch_env", "expand_nodelist", "learning_rate",
    "lockstep_idle_fraction", "lockstep_rounds", "lr_scale", "micro_batch_size", "parse_layout",
    "partition_layers", "partition_model", "pipeline_schedule", "print0", "read_checkpoint",
    "read_timeline", "run", "save0", "shard_indices", "simulate_schedule", "trainer_options",
    "validate_schedule",
]
__version__ = "0.1.0"
