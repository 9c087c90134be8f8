"""The hand-written faults ``tools/faults.py`` applies: one exact text edit of one file each,
and the tests that must catch it (see that script and docs/faults.md)."""

from __future__ import annotations

import dataclasses

CONFORMANCE_2 = ("tests/adapters/test_conformance.py::"
                 "test_two_ranks_broadcast_reduce_and_update_identically")
STEPS_MATCH = "tests/adapters/test_conformance.py::test_steps_match_the_numpy_reference"
# jax-pjit's data-parallel step, where the compiler has already averaged the gradient
PJIT_GRADS = ("        grads, losses, new_state = self._accumulated_grads(params, model_state, x, "
              "y, key,\n"
              "                                                           scale=scale)\n")
JAX_PIPELINE = "tests/adapters/test_pipeline_jax.py::test_stages_in_one_process_equal_the_reference"


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str  # what goes wrong, shared by the backends it applies to
    backend: str  # "horovod-torch", "horovod-tf", "jax-pmap", "jax-pjit" or "core"
    file: str  # relative to the repository root
    old: str  # exact text, found exactly once in ``file``
    new: str
    tests: tuple[str, ...]  # pytest node ids or options (-k ...), the smallest that must fail
    what: str  # one line for the docs

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.backend}"


FAULTS: list[Fault] = [
    # -------------------------------------------------------------- 1. not averaged (summed)
    Fault("not-averaged", "horovod-torch", "adapters/horovod_torch/data_parallel.py",
          "op=hvd.Average, backward_passes_per_step=self.accumulation_steps,",
          "op=hvd.Sum, backward_passes_per_step=self.accumulation_steps,",
          (f"{CONFORMANCE_2}[horovod-torch]",),
          "DistributedOptimizer with op=hvd.Sum"),
    Fault("not-averaged", "horovod-tf", "adapters/horovod_tf/data_parallel.py",
          'hvd.allreduce(g, op=hvd.Average, name=f"grad_{i}", compression=compression)',
          'hvd.allreduce(g, op=hvd.Sum, name=f"grad_{i}", compression=compression)',
          (f"{CONFORMANCE_2}[horovod-tf]",),
          "gradient allreduce with op=hvd.Sum"),
    Fault("not-averaged", "jax-pmap", "adapters/jax_pmap/data_parallel.py",
          'grads = lax.pmean(grads, axis_name="batch")',
          'grads = lax.psum(grads, axis_name="batch")',
          (f"{STEPS_MATCH}[mlp-sgd-jax-pmap]",),
          "lax.psum instead of lax.pmean (2 local devices in the test process)"),
    Fault("not-averaged", "jax-pjit", "adapters/jax_pjit/data_parallel.py",
          PJIT_GRADS,
          PJIT_GRADS +
          "        grads = self.jax.tree_util.tree_map(lambda g: g * self.mesh.size, grads)\n",
          (f"{STEPS_MATCH}[mlp-sgd-jax-pjit]",),
          "the gradient times the data-axis size (the devices' mean losses summed)"),
    # the sharded layouts' own reductions (jax-pjit's are the compiler's: none to break)
    Fault("not-averaged-sharded", "horovod-torch", "adapters/horovod_torch/flat_shards.py",
          'hvd.reducescatter(flat, op=hvd.Average, name=f"zero.grad.{unit}",',
          'hvd.reducescatter(flat, op=hvd.Sum, name=f"zero.grad.{unit}",',
          ("tests/test_sharded.py::test_every_stage_equals_the_reference[horovod-torch]",),
          "stages 2 and 3: the gradient reduce-scatter with op=hvd.Sum"),
    Fault("not-averaged-sharded", "horovod-tf", "adapters/horovod_tf/flat_shards.py",
          "shard = self.hvd.reducescatter(flat, op=self.hvd.Average, **self._in)",
          "shard = self.hvd.reducescatter(flat, op=self.hvd.Sum, **self._in)",
          ("tests/test_sharded.py::test_every_stage_equals_the_reference[horovod-tf]",),
          "stages 2 and 3: the gradient reduce-scatter with op=hvd.Sum"),
    Fault("replicas-not-averaged", "horovod-torch", "adapters/horovod_torch/flat_shards.py",
          "        elif self.group.replicas is not None:",
          "        elif False:",
          ("tests/adapters/test_composed.py::"
           "test_hsdp_equals_the_reference_holds_its_estimate_and_resumes[horovod-torch]",),
          "HSDP: each replica's gradient shards not averaged across the replicas"),
    Fault("held-gradient-not-reduced", "horovod-torch", "adapters/horovod_torch/flat_shards.py",
          "                self._scatter(unit, flat)",
          "                pass",
          ("tests/adapters/test_composed.py::"
           "test_pipeline_x_zero_equals_the_reference_counts_its_collectives_and_resumes"
           "[horovod-torch-False]",),
          "pipeline x ZeRO, gathered once per step: the step's whole gradient sum never "
          "reduce-scattered into the shards"),
    Fault("tied-shard-not-summed", "horovod-torch", "adapters/horovod_torch/flat_shards.py",
          "            if unit in self.whole:  # (averaged whole with the other holders: my shard)",
          "            if False:",
          ("tests/adapters/test_composed.py::"
           "test_pipeline_x_zero_equals_the_reference_counts_its_collectives_and_resumes"
           "[horovod-torch-False]",),
          "pipeline x ZeRO: a tied embedding's unit reduced within its stage only, the end "
          "stages' copies untied"),
    Fault("not-averaged-sharded", "jax-pmap", "adapters/jax_pmap/sharded.py",
          "grads = tmap(lambda g: g / n, grads)",
          "grads = tmap(lambda g: g, grads)",
          ("tests/adapters/test_sharded_jax.py::"
           "test_stage_3_with_accumulation_custom_loss_and_metric_equals_data_parallel"
           "[jax-pmap]",),
          "stage 3: the all-gathers' transposes (a sum over devices) not divided by their "
          "number"),
    # -------------------------------------------------------------- 2. averaged twice
    Fault("averaged-twice", "horovod-torch", "adapters/horovod_torch/data_parallel.py",
          "            self.precision.scale_loss(loss, scale).backward()",
          "            (self.precision.scale_loss(loss, scale) / self.env.world_size).backward()",
          (f"{CONFORMANCE_2}[horovod-torch]",),
          "the local loss divided by the world size before Horovod's average"),
    Fault("averaged-twice", "horovod-tf", "adapters/horovod_tf/data_parallel.py",
          'hvd.allreduce(g, op=hvd.Average, name=f"grad_{i}", compression=compression)',
          'hvd.allreduce(g / hvd.size(), op=hvd.Average, name=f"grad_{i}", '
          'compression=compression)',
          (f"{CONFORMANCE_2}[horovod-tf]",),
          "each gradient divided by the world size before the averaging allreduce"),
    Fault("averaged-twice", "jax-pmap", "adapters/jax_pmap/data_parallel.py",
          'grads = lax.pmean(grads, axis_name="batch")',
          "grads = self.jax.tree_util.tree_map(\n"
          '            lambda g: lax.pmean(g, axis_name="batch") / lax.psum(1, "batch"), grads)',
          (f"{STEPS_MATCH}[mlp-sgd-jax-pmap]",),
          "lax.pmean, then divided by the device count again"),
    Fault("averaged-twice", "jax-pjit", "adapters/jax_pjit/data_parallel.py",
          PJIT_GRADS,
          PJIT_GRADS +
          "        grads = self.jax.tree_util.tree_map(lambda g: g / self.mesh.size, grads)\n",
          (f"{STEPS_MATCH}[mlp-sgd-jax-pjit]",),
          "the compiler's global-batch mean divided by the data-axis size again"),
    # -------------------------------------------------------------- 3. fixed dropout seed
    Fault("fixed-dropout-seed", "horovod-torch", "adapters/horovod_torch/data_parallel.py",
          "step_seed(self.seed, self.steps, self.env.rank)",
          "step_seed(self.seed, 0, self.env.rank)",
          ("tests/adapters/test_model_state.py::"
           "test_dropout_draws_differ_between_steps_but_not_between_runs",),
          "torch.manual_seed from step 0 on every step"),
    Fault("fixed-dropout-seed", "horovod-tf", "adapters/horovod_tf/data_parallel.py",
          "self.keras_model.seeds(self.seed, self.state.steps, self.env.rank)",
          "self.keras_model.seeds(self.seed, 0, self.env.rank)",
          ("tests/adapters/test_keras_native.py::"
           "test_dropout_draws_differ_between_steps_but_not_between_runs",),
          "the Keras generators reseeded from step 0 on every step"),
    Fault("fixed-dropout-seed", "jax-pmap", "adapters/jax_pmap/data_parallel.py",
          "self.jax.random.fold_in(self.jax.random.PRNGKey(seed), ",
          "self.jax.random.fold_in(self.jax.random.PRNGKey(0), ",
          ("tests/adapters/test_model_state.py::"
           "test_flax_dropout_draws_differ_between_steps_but_not_between_runs[jax-pmap]",),
          "the dropout key from PRNGKey(0), not the step's seed"),
    Fault("fixed-dropout-seed", "jax-pjit", "adapters/jax_pjit/data_parallel.py",
          "key = self.jax.random.PRNGKey(seed)",
          "key = self.jax.random.PRNGKey(0)",
          ("tests/adapters/test_model_state.py::"
           "test_flax_dropout_draws_differ_between_steps_but_not_between_runs[jax-pjit]",),
          "the dropout key from PRNGKey(0), not the step's seed"),
    # -------------------------------------------------------------- 4. sampler epoch seed
    Fault("sampler-epoch-seed", "core", "toolkit/data/sampler.py",
          "np.random.default_rng([self.seed, epoch])",
          "np.random.default_rng([self.seed, 0])",
          ("tests/toolkit/test_sampler.py::"
           "test_every_rank_shuffles_identically_and_epochs_differ",),
          "every epoch's permutation drawn from epoch 0's seed"),
    # -------------------------------------------------------------- 5. no initial broadcast
    Fault("no-initial-broadcast", "horovod-torch", "adapters/horovod_torch/data_parallel.py",
          "        hvd.broadcast_parameters(self.net.state_dict(), root_rank=0)  # parameters "
          "and buffers\n",
          "        pass  # (fault: hvd.broadcast_parameters skipped)\n",
          (f"{CONFORMANCE_2}[horovod-torch]",),
          "hvd.broadcast_parameters at build skipped"),
    Fault("no-initial-broadcast", "horovod-tf", "adapters/horovod_tf/data_parallel.py",
          "        state.broadcast(self.hvd)\n",
          "        pass  # (fault: state.broadcast skipped)\n",
          (f"{CONFORMANCE_2}[horovod-tf]",),
          "the broadcast of variables and slots at build skipped"),
    Fault("no-initial-broadcast", "jax-pmap", "adapters/_jax/strategy.py",
          "        if self.env.world_size > 1:  # rank 0's initial state becomes everyone's\n",
          "        if False:  # (fault: broadcast skipped)\n",
          (f"{CONFORMANCE_2}[jax-pmap]",),
          "broadcast_one_to_all of the initial state skipped (shared adapters/_jax/strategy.py)"),
    Fault("no-initial-broadcast", "jax-pjit", "adapters/_jax/strategy.py",
          "        if self.env.world_size > 1:  # rank 0's initial state becomes everyone's\n",
          "        if False:  # (fault: broadcast skipped)\n",
          (f"{CONFORMANCE_2}[jax-pjit]",),
          "broadcast_one_to_all of the initial state skipped (shared adapters/_jax/strategy.py)"),
    # -------------------------------------------------------------- 6. a shard's padding
    Fault("padding-not-zeroed", "core", "toolkit/parallel/shards.py",
          "        flat = np.zeros(self.padded, dtype)\n",
          "        flat = np.ones(self.padded, dtype)\n",
          ("tests/toolkit/test_layouts.py", "-k", "test_shard_gather_round_trip"),
          "FlatLayout.flatten leaves ones in the padding"),
    Fault("padding-in-pieces", "core", "toolkit/parallel/shards.py",
          "            a, b = max(lo, start), min(hi, start + size)\n",
          "            a, b = max(lo, start), min(hi, start + size)\n"
          "            if name == self.names[-1]:  # (fault: the padding counted)\n"
          "                b = hi\n",
          ("tests/toolkit/test_layouts.py::test_flatten_unflatten_and_errors",),
          "FlatLayout.owned: the last tensor's piece runs on into the padding "
          "(horovod-torch's and horovod-tf's checkpoint pieces)"),
    Fault("padding-in-pieces", "jax-pmap", "adapters/_jax/flat_units.py",
          "            a, b = max(lo, start), min(lo + len(data), start + size)\n",
          "            a, b = max(lo, start), min(lo + len(data), start + size)\n"
          "            if name == layout.names[-1]:  # (fault: the padding counted)\n"
          "                b = lo + len(data)\n",
          ("tests/adapters/test_sharded_jax.py::"
           "test_checkpoint_pieces_of_padded_units_are_the_owned_slices[jax-pmap]",),
          "FlatUnits.pieces: the last tensor's piece runs on into the padding (shared "
          "adapters/_jax/flat_units.py)"),
    Fault("padding-in-pieces", "jax-pjit", "adapters/_jax/flat_units.py",
          "            a, b = max(lo, start), min(lo + len(data), start + size)\n",
          "            a, b = max(lo, start), min(lo + len(data), start + size)\n"
          "            if name == layout.names[-1]:  # (fault: the padding counted)\n"
          "                b = lo + len(data)\n",
          ("tests/adapters/test_sharded_jax.py::"
           "test_checkpoint_pieces_of_padded_units_are_the_owned_slices[jax-pjit]",),
          "FlatUnits.pieces: the last tensor's piece runs on into the padding (shared "
          "adapters/_jax/flat_units.py)"),
    # -------------------------------------------------------------- 7. a stage's gradient dropped
    Fault("stage-gradient-dropped", "horovod-torch", "adapters/horovod_torch/pipeline.py",
          'self.outbox[("SEND_B", m, c)] = inp.grad',
          'self.outbox[("SEND_B", m, c)] = self.torch.zeros_like(inp.grad)',
          ("tests/adapters/test_pipeline_torch.py::"
           "test_gradients_are_averaged_in_horovod_process_sets[horovod-torch-2-4]",),
          "zeros sent back to the previous stage instead of its input's gradient"),
    Fault("stage-gradient-dropped", "horovod-tf", "adapters/horovod_tf/pipeline.py",
          'self.outbox[("SEND_B", m, c)] = grads[0]',
          'self.outbox[("SEND_B", m, c)] = tf.zeros_like(grads[0])',
          ("tests/adapters/test_pipeline_tf.py::test_1f1b_equals_the_reference_at_two_ranks",),
          "zeros sent back to the previous stage instead of its input's gradient"),
    Fault("stage-gradient-dropped", "jax-pmap", "adapters/_jax/programs.py",
          "bx.at[out].set(self._pack(gh))",
          "bx.at[out].set(self._pack(jnp.zeros_like(gh)))",
          (f"{JAX_PIPELINE}[pipeline:2:4:gpipe-1-jax-pmap]",),
          "zeros sent back to the previous stage (shared adapters/_jax/programs.py)"),
    Fault("stage-gradient-dropped", "jax-pjit", "adapters/_jax/programs.py",
          "bx.at[out].set(self._pack(gh))",
          "bx.at[out].set(self._pack(jnp.zeros_like(gh)))",
          (f"{JAX_PIPELINE}[pipeline:2:4:gpipe-1-jax-pjit]",),
          "zeros sent back to the previous stage (shared adapters/_jax/programs.py)"),
    # -------------------------------------------------------------- 8. the device's counters
    Fault("skip-not-counted", "jax-pjit", "adapters/_update.py",
          "c.skips + xp.where(finite, zero, zero + 1)",
          "c.skips + xp.where(finite, zero, zero)",
          ("tests/adapters/test_update_seam.py::"
           "test_a_deferred_step_equals_a_step_read_on_the_host_bit_for_bit",),
          "a deferred step does not count its skip: the next steps take the wrong Adam "
          "scalars and the host's count goes wrong (adapters/_update.py: every deferring family)"),
    Fault("growth-one-step-early", "jax-pjit", "adapters/_update.py",
          "grown = good + 1 >= scaler.growth_interval",
          "grown = good + 2 >= scaler.growth_interval",
          ("tests/adapters/test_update_seam.py::"
           "test_a_deferred_rule_restored_from_a_checkpoint_goes_on_as_an_uninterrupted_one",),
          "the device's loss scale doubles one clean step early (adapters/_update.py: every "
          "deferring family)"),
]
