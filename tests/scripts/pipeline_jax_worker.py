"""A jax-pjit or jax-pmap pipeline run beside the float64 reference
(tests/adapters/test_pipeline_jax.py).

    python tests/scripts/pipeline_jax_worker.py --backend jax-pmap --layout pipeline:2:4:1f1b ...

The adapter's own executor is attached (``attach``: a process that holds several stages gives
each device its own samples) and the Trainer runs its ordinary loop: sampler, loss averaging and
checkpoints are the Trainer's own. Each rank reports (``_emit.emit``)
per-step losses, their largest relative deviation from ``toolkit.equivalence.reference``, the
largest absolute parameter deviation, and the measured timeline's idle fraction.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np
from _emit import emit

import adapters
import toolkit
from toolkit.equivalence import _comparable, load_data, make_model, make_optimizer
from toolkit.models.reference import reference_run


def attach(adapter, layout, samples="replica"):
    """The adapter's own pipeline executor for ``layout`` (what ``setup`` makes), kept when
    the Trainer calls ``setup`` again.

    ``samples="replica"``: the Trainer runs ``layout`` (its sampler gives a pipeline replica's
    processes the same samples); ``"process"``: the Trainer runs data parallel (every process
    its own samples, e.g. one process holding both stages on two devices)."""
    adapter.setup(adapter.env, layout)
    if samples != "replica":
        adapter.strategy = type(adapter.strategy)(adapter.runtime, layout, adapter.precision,
                                                  samples=samples)
    executor, setup = adapter.strategy, adapter.setup

    def keep(env, given=None):  # the runtime stays set up; the executor stays the strategy
        setup(env, given)
        adapter.strategy, adapter.layout = executor, layout

    adapter.setup = keep
    return executor


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layout", required=True)
    p.add_argument("--backend", default="jax-pjit", choices=("jax-pjit", "jax-pmap"))
    p.add_argument("--model", default="mlp")
    p.add_argument("--optimizer", default="adam")
    p.add_argument("--dtype", default="float64")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--local-devices", type=int, default=None)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--layers", type=int, default=None,
                   help="the preset's hidden layers (MLP) or blocks (GPT) instead of its own")
    p.add_argument("--pieces-dir", default=None,
                   help="write sharded_state() as a checkpoint there, and state_dict() beside it")
    p.add_argument("--width", type=int, default=32, help="hidden width with --layers (MLP)")
    p.add_argument("--timeline-dir", default=None, help="write this rank's records there")
    p.add_argument("--data-parallel", action="store_true",
                   help="no pipeline: the adapter's data parallelism (for step times)")
    p.add_argument("--no-reference", action="store_true")
    args = p.parse_args()
    env = toolkit.current_env()
    adapter = adapters.get(args.backend, dtype=args.dtype, local_devices=args.local_devices)
    adapter.setup(env)
    layout = toolkit.parse_layout(args.layout)
    samples = "replica" if env.world_size % layout.stages == 0 else "process"
    pipe = None if args.data_parallel else attach(adapter, layout, samples)
    x, y = load_data(args.model, args.dtype)
    seconds = []
    step = adapter.train_step

    def timed(xb, yb, lr):
        start = time.perf_counter()
        loss = step(xb, yb, lr)
        float(loss)
        seconds.append(time.perf_counter() - start)
        return loss

    adapter.train_step = timed
    model = make_model(args.model)
    if args.layers and args.model == "gpt":
        model = dataclasses.replace(model, layers=args.layers)
    elif args.layers:
        model = toolkit.MLP((64, *[args.width] * args.layers, 10))
    trainer = toolkit.Trainer(adapter, model,
                              make_optimizer(args.optimizer, args.steps),
                              global_batch_size=args.batch_size, max_steps=args.steps,
                              seed=args.seed, progress=False, checkpoint_dir=args.checkpoint_dir,
                              layout=layout if samples == "replica" and pipe else None,
                              checkpoint_every=args.steps if args.checkpoint_dir else None)
    history = trainer.fit(x, y)
    state = adapter.state_dict()
    result = {"losses": history.losses, "step_seconds": float(np.median(seconds[3:]))}
    if pipe is not None:
        result.update(memory=pipe.memory_bytes(), slots=pipe.plan.slots,
                      rounds=len(pipe.plan.rounds))
    records = pipe.timeline() if pipe is not None else []
    if args.timeline_dir and records:
        from toolkit.parallel.pipeline.timeline import write_timeline

        write_timeline(records, f"{args.timeline_dir}/rank{env.rank}.jsonl")
    if records:
        from toolkit.parallel.pipeline.timeline import idle_fraction, peak_in_flight

        last = max(r["step"] for r in records)
        mine = [r for r in records if r["step"] == last]
        # This process's stages only: the idle fraction is over the stages it holds.
        result["stages_here"] = sorted({r["stage"] for r in mine})
        result["records"] = mine
        result["idle_here"] = idle_fraction(mine)
        result["peak_in_flight"] = peak_in_flight(mine)
    if args.pieces_dir:
        from toolkit.checkpoint.store import CheckpointStore

        replicated, pieces = adapter.sharded_state()
        CheckpointStore(args.pieces_dir, rank=env.rank).save(
            args.steps, replicated, {"layout": layout.name}, shards=pieces,
            barrier=adapter.barrier)
        toolkit.save0(f"{args.pieces_dir}/full.npz", lambda f: np.savez(f, **state), env=env)
    if not args.no_reference and env.rank == 0:
        ref_losses, ref_params = reference_run(
            model, make_optimizer(args.optimizer, args.steps), "cross_entropy",
            *load_data(args.model, "float64"), global_batch_size=args.batch_size,
            steps=args.steps, seed=args.seed, dtype="float64")
        losses = np.asarray(history.losses)
        result["max_rel_loss_dev"] = float(np.max(np.abs(losses - ref_losses)
                                                  / np.abs(ref_losses)))
        result["max_abs_param_dev"] = max(
            float(np.max(np.abs(_comparable(k, state[f"params/{k}"].astype(np.float64))
                                - _comparable(k, v)))) for k, v in ref_params.items())
    emit(result)


if __name__ == "__main__":
    toolkit.run(main)
