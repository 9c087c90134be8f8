"""Started by tests/adapters/test_composed.py: pipeline x ZeRO, ``pipeline:2:2+sharded:Z`` on
4 ranks (2 stages, each sharded over its 2 replicas), in float64 with Adam and clipping:
``worker.py BACKEND FOLDER [quick]`` (quick: ZeRO-3 only).

1. At ZeRO 1, 2 and 3 (gathered once per step, and per micro-batch) its losses and parameters
   equal the one-process float64 reference's (1e-10), and its checkpoint (each replica's pieces
   of its stage's shards) reads back as that state.
2. Each step's gathers and reduce-scatters are the formula's: per unit of the stage, ZeRO-3
   gathers once per step (gather=step) or ``2 M`` times (each micro-batch's forward and its
   backward, ``M`` for the first layer's: gather=micro-batch); ZeRO-2/3 reduce-scatter once per
   step or ``M`` times.
3. The bytes each rank holds are ``toolkit.memory.estimate``'s for its stage's parameters over
   the stage's 2 shards, and their mean over the stages is the estimate of the composed layout.
4. Its checkpoint resumes as data parallel as the reference goes on, and as the same layout bit
   for bit as the run that was not interrupted.
5. A GPT whose embedding two stages hold (tied) trains as under data parallelism.
Prints one ``ok <check>`` line per check; any mismatch raises.
"""

import shutil
import sys
from pathlib import Path

import numpy as np

import adapters
import toolkit
from toolkit import memory
from toolkit.models.reference import reference_run

MODEL = toolkit.MLP((5, 6, 6, 4))  # stage 0: a unit of 36; stage 1: 42 and 28 (no padding)
OPTIMIZER, CLIP, M, STEPS = toolkit.Adam(lr=1e-2), 0.5, 2, 3


def data():
    rng = np.random.default_rng(0)
    return rng.standard_normal((96, 5)), rng.integers(0, 4, 96)


def composed_stage(count: int, layout: str):
    """The estimate of one stage of ``layout`` holding ``count`` parameters (2 replicas)."""
    one = toolkit.parse_layout(layout.replace("pipeline:2:", "pipeline:1:"))
    return memory.estimate(count, one, 2, "float32", "adam")


def run(layout, steps, folder=None, resume=False):
    adapter = adapters.get(BACKEND, dtype="float64")
    trainer = toolkit.Trainer(adapter, MODEL, OPTIMIZER, global_batch_size=16,
                              max_steps=steps, progress=False, layout=layout,
                              clip_grad_norm=CLIP, checkpoint_dir=folder,
                              checkpoint_every=steps if folder else None,
                              resume="auto" if resume else None)
    return adapter, trainer.fit(*data())


def main(folder: Path) -> None:
    reference = {n: reference_run(MODEL, OPTIMIZER, "cross_entropy", *data(), steps=n,
                                  global_batch_size=16, clip_grad_norm=CLIP)
                 for n in (STEPS, 5)}
    # (horovod-tf gathers once per step only: its refusal is tested apart)
    gathers = ("micro-batch", "step") if BACKEND == "horovod-torch" else ("step",)
    zeros = () if QUICK else ((1, "step"), (2, "step"))
    for zero, gather in (*zeros, *((3, g) for g in gathers)):
        layout = f"pipeline:2:{M}+sharded:{zero}" + (
            ":gather=micro-batch" if gather != "step" else "")
        saves = folder if gather == "step" and zero == 3 else folder.with_name(f"zero-{zero}")
        adapter, history = run(layout, STEPS, saves)
        rank, shards = adapter.env.rank, adapter.strategy.shards
        state, held = adapter.state_dict(), adapter.memory_bytes()
        losses, params = reference[STEPS]
        np.testing.assert_allclose(history.losses, losses, rtol=1e-10)
        for name, value in params.items():
            np.testing.assert_allclose(state[f"params/{name}"], value, atol=1e-10, err_msg=name)
        print(f"ok {layout} equals the reference on rank {rank}", flush=True)
        # its checkpoint (each replica's pieces of its stage's shards) holds that state
        saved = toolkit.read_checkpoint(sorted(saves.glob("step_*"))[-1])
        for name, value in state.items():
            np.testing.assert_array_equal(saved.tensors[name], value, err_msg=name)

        units, per_step = len(shards.layouts), M if gather != "step" else 1
        # (per micro-batch a unit is gathered again for its backward only where that needs
        # its weights: not the first layer's, whose input takes no gradient)
        uses = 1 if gather == "step" else (1 if adapter.strategy.stage == 0 else 2)
        expected = {"gather": units * uses * per_step * STEPS if zero == 3 else 0,
                    "reduce_scatter": units * per_step * STEPS if zero >= 2 else 0}
        assert shards.collectives == expected, (layout, shards.collectives, expected)
        print(f"ok {layout} collectives {shards.collectives} on rank {rank}", flush=True)

        mine = sum(int(np.prod(fl.shapes[i])) for fl in shards.layouts
                   for i in range(len(fl.names)))
        est = memory.estimate(mine, toolkit.Sharded(zero), 2, "float32", "adam")
        assert held == {"params": 2 * est.params, "grads": 2 * est.grads,
                        "optimizer": 2 * est.optimizer}, (held, est)  # (float64)
        total = sum(a.size for a in MODEL.init(0).values())
        composed = memory.estimate(total, toolkit.parse_layout(layout), 4, "float32", "adam")
        means = adapter.allreduce(np.asarray([held["params"], held["grads"],
                                              held["optimizer"]], np.float64))
        np.testing.assert_allclose(means, [2 * composed.params, 2 * composed.grads,
                                           2 * composed.optimizer])
        # while a step runs: the stage's whole parameters (ZeRO-3) and gradient sum (2, 3)
        # gathered once per step, as the estimate says; per micro-batch less than that
        peak, whole = shards.peak_transient, 2 * composed_stage(mine, layout).gathered
        assert (peak == whole) if gather == "step" else (0 < peak < 8 * mine * 2), (peak, whole)
        print(f"ok {layout} bytes equal the estimate on rank {rank}: {held}, {peak} in a step",
              flush=True)
    # (the last run, ZeRO-3 gathered once per step, saved its state at step 3 in folder)
    if rank == 0:  # (each resumed run saves its step 5: from copies of step 3)
        shutil.copytree(folder, folder.with_name("as-data"))
    adapter.barrier()
    _, whole = run(layout, 5)
    _, resumed = run(layout, 5, folder, resume=True)
    np.testing.assert_array_equal(resumed.losses[-2:], whole.losses[STEPS:])
    print(f"ok the checkpoint resumes as {layout} bit for bit on rank {rank}", flush=True)
    _, as_data = run("data", 5, folder.with_name("as-data"), resume=True)
    np.testing.assert_allclose(as_data.losses[-2:], reference[5][0][STEPS:], rtol=1e-10)
    print(f"ok the checkpoint resumes as data parallel on rank {rank}", flush=True)

    # a weight two stages hold (a tied GPT's embedding: a unit of its own on both end stages,
    # its gradient summed over both) trains as under data parallelism
    gpt = toolkit.GPT(vocab=16, context=4, width=8, layers=2, heads=2)
    tokens = np.random.default_rng(1).integers(0, 16, (32, 5))
    runs = {}
    for each in ("data", f"pipeline:2:{M}+sharded:3"):
        tied = adapters.get(BACKEND, dtype="float64")
        runs[each] = toolkit.Trainer(tied, gpt, OPTIMIZER, global_batch_size=8, max_steps=3,
                                     progress=False, layout=each, clip_grad_norm=CLIP).fit(
            tokens[:, :-1], tokens[:, 1:]).losses, tied.state_dict()
    (data_losses, data_state), (losses, state) = runs.values()
    np.testing.assert_allclose(losses, data_losses, rtol=1e-10)
    for name, value in data_state.items():
        np.testing.assert_allclose(state[name], value, atol=1e-10, err_msg=name)
    print(f"ok a tied embedding trains as under data parallelism on rank {rank}", flush=True)

if __name__ == "__main__":
    BACKEND, QUICK = sys.argv[1], sys.argv[3:] == ["quick"]  # quick: ZeRO-3 only
    main(Path(sys.argv[2]) / "pipeline-zero")
