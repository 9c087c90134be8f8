"""Multi-rank checks of the Horovod backends' pipeline stages; reports one result per rank (_emit).

    horovodrun -np 2 --gloo python tests/scripts/pipeline_torch_worker.py equivalence SCHEDULE
    horovodrun -np 2 --gloo python tests/scripts/pipeline_torch_worker.py equivalence SCHEDULE \
        DIR horovod-tf
    horovodrun -np 2 --gloo python tests/scripts/pipeline_torch_worker.py bubble DIR
    horovodrun -np 2 --gloo python tests/scripts/pipeline_torch_worker.py keras

``equivalence``: the digits MLP and a small tied GPT trained with the Trainer under
``Pipeline(2, 4, SCHEDULE)`` in float64, against the one-process numpy reference (losses and
final parameters), then a checkpoint written by every rank read back as the full model; with
the backend ``horovod-tf`` as a third argument the same checks run on that backend.
``bubble``: an MLP whose micro-batches take tens of milliseconds, S = 2, M = 8, GPipe then 1F1B
with the timeline recorded into DIR; the measured idle fraction and peak in-flight activations.
``crash [BACKEND]`` (with ``CRASH_RANK``): that rank is killed in the middle of its second step.
``keras``: horovod-tf, a Keras Sequential cut into 2 stages against data parallel.
``message_bytes [BACKEND]``: the bytes of each rank's round messages in float32 and in
bf16-mixed, and an evaluation's loss in each (its activations handed on as 16-bit values).
``tied``: horovod-torch, a float64 ``nn.Sequential`` whose head is tied to its embedding (one
Parameter object in two layers) under data parallel and under every pipeline schedule on 2
stages: each schedule's losses and final state against data parallel's, and each end stage's
copy of the tied weight.
``process_sets BACKEND STAGES``: a tied GPT in float64 under ``Pipeline(STAGES, 4)`` on every
launched rank, against the numpy reference, with the Horovod process sets its gradients were
averaged in; then (``STAGES`` = 2 on 4 ranks) a second Trainer in the same processes whose
layout needs a set Horovod was not started with.
"""

import os
import sys

import numpy as np
from _emit import emit

import toolkit
from toolkit.checkpoint.store import read_checkpoint


def executor_of(adapter):
    """The adapter's pipeline strategy (None without a pipeline layout)."""
    from adapters._horovod.pipeline import HvdPipeline

    return adapter.strategy if isinstance(adapter.strategy, HvdPipeline) else None


def _crash_mid_schedule(pipeline) -> None:
    """SIGKILLs this rank at its second step's backward of micro-batch 1 (others are then
    waiting in the round's alltoall)."""
    import signal
    import time

    real = pipeline._compute

    def compute(action):
        if pipeline.steps == 1 and str(action) == "B1":
            print(f"killing rank {pipeline.env.rank} at {action} at time {time.time()}",
                  flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return real(action)

    pipeline._compute = compute


def crash(backend: str = "horovod-torch") -> None:
    """Trains under Pipeline(2, 4); CRASH_RANK dies in the middle of a step's schedule."""
    import adapters
    from toolkit.datasets import load_digits

    adapter = adapters.get(backend)
    build = adapter.build

    def build_then_arm(*args, **kwargs):  # the executor exists once the adapter is built
        build(*args, **kwargs)
        if os.environ.get("CRASH_RANK") == str(adapter.env.rank):
            _crash_mid_schedule(executor_of(adapter))

    adapter.build = build_then_arm
    (x, y), _ = load_digits()
    toolkit.Trainer(adapter, toolkit.MLP((64, 32, 10)), toolkit.SGD(lr=0.1),
                    layout="pipeline:2:4", global_batch_size=32, max_steps=1000,
                    progress=False).fit(x, y)


def _mlp_eval(state: dict, x: np.ndarray, y: np.ndarray) -> dict:
    """The digits MLP's mean loss and accuracy from full parameters, in numpy."""
    h = x
    layers = sorted({k.split(".")[1] for k in state if k.startswith("params/layers.")})
    for i in range(len(layers)):
        h = h @ state[f"params/layers.{i}.kernel"] + state[f"params/layers.{i}.bias"]
        h = np.maximum(h, 0) if i < len(layers) - 1 else h
    h = h - h.max(axis=1, keepdims=True)
    logp = h - np.log(np.exp(h).sum(axis=1, keepdims=True))
    return {"val_loss": float(-logp[np.arange(len(y)), y].mean()),
            "val_accuracy": float((h.argmax(axis=1) == y).mean())}


def equivalence(schedule: str, folder: str, backend: str = "horovod-torch") -> None:
    """Float64 training under Pipeline(2, 4, schedule) against the numpy reference (an
    interleaved schedule: 2 chunks per stage of 4-layer models) on ``backend``."""
    import adapters

    def pipelined():
        return adapters.get(backend, dtype="float64")

    from toolkit.datasets import load_digits
    from toolkit.equivalence import load_data, make_model, make_optimizer
    from toolkit.models.reference import reference_run

    interleaved = schedule == "interleaved-1f1b"
    layout = f"pipeline:2:4:{schedule}" + (":2" if interleaved else "")
    models = {"mlp": toolkit.MLP((64, 32, 32, 32, 10)) if interleaved else make_model("mlp"),
              "gpt": toolkit.GPT(vocab=256, context=16, width=32, layers=4, heads=2)
              if interleaved else make_model("gpt")}
    result = {"rank": toolkit.current_env().rank}
    for name, optimizer, steps in (("mlp", "sgd", 6), ("gpt", "adam", 4)):
        x, y = load_data(name, "float64")
        model, opt = models[name], make_optimizer(optimizer, steps)
        ref_losses, ref_params = reference_run(model, opt, "cross_entropy", x, y,
                                               global_batch_size=16, steps=steps, seed=0,
                                               dtype="float64")
        adapter = pipelined()
        ckpt_dir = os.path.join(folder, f"{name}-{schedule}")
        trainer = toolkit.Trainer(adapter, model, opt, layout=layout, checkpoint_every=3,
                                  global_batch_size=16, max_steps=steps, progress=False,
                                  checkpoint_dir=ckpt_dir)
        history = trainer.fit(x, y)
        state = adapter.state_dict()
        ckpt = read_checkpoint(trainer.store.checkpoints()[-1])
        losses = np.asarray(history.losses)
        result[name] = {
            "loss_dev": float(np.max(np.abs(losses - ref_losses) / np.abs(ref_losses))),
            "param_dev": max(float(np.max(np.abs(state[f"params/{k}"] - v)))
                             for k, v in ref_params.items()),
            "ckpt_dev": max(float(np.max(np.abs(ckpt.tensors[k] - state[k]))) for k in state),
            "ckpt_names": sorted(ckpt.tensors) == sorted(state),
            "position": list(adapter.pipeline_position()),
            "bytes": adapter.memory_bytes()}
        if name == "mlp":  # resumed from step 3: bit for bit here, and onto data parallel
            middle = os.path.join(ckpt_dir, "step_000000003")
            for resumed, where in ((pipelined(), layout),
                                   (adapters.get(backend, dtype="float64"), "data")):
                toolkit.Trainer(resumed, model, opt, layout=where, global_batch_size=16,
                                max_steps=steps, progress=False, resume=middle).fit(x, y)
                again = resumed.state_dict()
                result[name][f"resume_dev_{where.split(':')[0]}"] = max(
                    float(np.max(np.abs(again[k] - state[k]))) for k in state)
        if name == "mlp":  # evaluation through the pipeline (101 samples: uneven shares)
            _, (xv, yv) = load_digits(dtype="float64")
            got, want = trainer.evaluate(xv[:101], yv[:101]), _mlp_eval(state, xv[:101],
                                                                        yv[:101])
            result[name]["eval_dev"] = max(abs(got[k] - want[k]) for k in want)
    emit(result)


def bubble(folder: str, batch: str = "512", steps: str = "4") -> None:
    """S = 2, M = 8 on an MLP whose micro-batch forward takes tens of milliseconds per stage:
    GPipe, 1F1B, then data parallel on the same ranks for the step time. Per step: the measured
    idle fraction (waiting and messages count as idle) and the share of the step the round
    alltoalls took on the rank that waited least in each (the communication itself)."""
    import time

    import torch

    import adapters
    from toolkit.datasets import load_digits
    from toolkit.parallel.pipeline.timeline import idle_fraction, peak_in_flight, select

    (x, y), _ = load_digits()
    model, steps = toolkit.MLP((64, 2048, 2048, 2048, 10)), int(steps)
    result = {"rank": toolkit.current_env().rank}
    for layout in ("pipeline:2:8:gpipe", "pipeline:2:8:1f1b", "data"):
        timeline = os.path.join(folder, layout.replace(":", "-"))
        os.environ["TOOLKIT_PIPELINE_TIMELINE"] = timeline
        adapter = adapters.get("horovod-torch")
        seconds, comm = [], []
        real_step = adapter.train_step

        def timed(xb, yb, lr, adapter=adapter, real_step=real_step, seconds=seconds,
                  comm=comm):
            start = time.perf_counter()
            loss = real_step(xb, yb, lr)
            seconds.append(time.perf_counter() - start)
            if executor_of(adapter) is not None:  # the least-waiting rank's time per round
                mine = torch.tensor(executor_of(adapter).exchange_seconds, dtype=torch.float64)
                every = adapter.runtime.hvd.allgather(mine[None])
                comm.append(float(every.min(dim=0).values.sum()))
            return loss

        adapter.train_step = timed
        toolkit.Trainer(adapter, model, toolkit.SGD(lr=0.01), layout=layout, progress=False,
                        global_batch_size=int(batch), max_steps=steps).fit(x, y)
        row = {"step_seconds": float(np.median(seconds[1:]))}
        if layout != "data":
            adapter.barrier()  # every rank's timeline is written
            records = toolkit.read_timeline([timeline])
            picked = [select(records, step) for step in range(1, steps)]  # after the first
            spans = [max(r["end"] for r in p) - min(r["start"] for r in p) for p in picked]
            row.update(bubbles=[idle_fraction(p) for p in picked],
                       comm_share=[c / s for c, s in zip(comm[1:], spans, strict=True)],
                       peak=peak_in_flight(picked[-1]), held=executor_of(adapter).peak_activations)
            row["bubble"] = float(min(row["bubbles"]))  # the least disturbed step
        result[layout] = row
    emit(result)


def message_bytes(backend: str = "horovod-torch") -> None:
    """The digits MLP (64-128-10) under Pipeline(2, 4) in float32 and in bf16-mixed: the bytes
    each rank's round messages took in the last step, and the loss of an evaluation after."""
    import adapters
    from toolkit.datasets import load_digits

    (x, y), _ = load_digits()
    result = {"rank": toolkit.current_env().rank}
    for precision in ("32", "bf16-mixed"):
        adapter = adapters.get(backend, precision=precision)
        trainer = toolkit.Trainer(adapter, toolkit.MLP((64, 128, 10)), toolkit.SGD(lr=0.05),
                                  layout="pipeline:2:4", global_batch_size=64, max_steps=2,
                                  progress=False)
        trainer.fit(x, y)
        result[precision] = executor_of(adapter).message_bytes
        result[f"eval {precision}"] = trainer.evaluate(x[:64], y[:64])["val_loss"]
    emit(result)


def keras_sequential() -> None:
    """horovod-tf: a float64 Keras Sequential (every rank draws other initial values: rank
    0's are broadcast) cut into 2 stages, against data parallel on the same ranks."""
    import keras

    import adapters
    from toolkit.datasets import load_digits

    keras.config.set_floatx("float64")
    (x, y), _ = load_digits(dtype="float64")
    result, runs = {"rank": toolkit.current_env().rank}, {}
    for layout in ("pipeline:2:4:1f1b", "data"):
        keras.utils.set_random_seed(toolkit.current_env().rank)
        net = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                                keras.layers.Dense(32, activation="tanh"),
                                keras.layers.Dense(10)])
        adapter = adapters.get("horovod-tf", dtype="float64")
        history = toolkit.Trainer(adapter, net, toolkit.SGD(lr=0.1, momentum=0.9),
                                  layout=layout, global_batch_size=16, max_steps=4,
                                  progress=False).fit(x, y)
        runs[layout] = (np.asarray(history.losses), adapter.state_dict())
        if layout != "data":
            result["params"] = adapter.memory_bytes()["params"]
    (piped, piped_state), (data, data_state) = runs.values()
    names = sorted(k for k in data_state if k.startswith("params/"))
    result.update(names=names, same_names=sorted(piped_state) == sorted(data_state),
                  loss_dev=float(np.max(np.abs(piped - data) / np.abs(data))),
                  param_dev=max(float(np.max(np.abs(piped_state[k] - data_state[k])))
                                for k in names))
    emit(result)


def tied() -> None:
    """See the module's docstring."""
    import torch

    import adapters
    from toolkit.equivalence import load_data

    x, y = load_data("gpt", "float64")
    result, runs = {"rank": toolkit.current_env().rank}, {}
    layouts = ("data", "pipeline:2:4:gpipe", "pipeline:2:4:1f1b",
               "pipeline:2:4:interleaved-1f1b:2")
    for layout in layouts:
        torch.manual_seed(toolkit.current_env().rank)  # rank 0's values are broadcast
        emb, head = torch.nn.Embedding(256, 16), torch.nn.Linear(16, 256, bias=False)
        head.weight = emb.weight  # GPT-2's tie: one Parameter in two layers
        net = torch.nn.Sequential(emb, torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                  torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                  torch.nn.Linear(16, 16), torch.nn.Tanh(), head)
        adapter = adapters.get("horovod-torch", dtype="float64")
        history = toolkit.Trainer(adapter, net, torch.optim.Adam(net.parameters(), lr=0.01),
                                  layout=layout, global_batch_size=16, max_steps=6,
                                  progress=False).fit(x, y)
        runs[layout] = (np.asarray(history.losses), adapter.state_dict())
        pipe = executor_of(adapter)
        if pipe is not None:  # this rank's own copy of the tied weight (both ends hold one)
            mine = dict(pipe._local())
            result[f"{layout} copy"] = mine["params/0.weight"].tolist()
            result[f"{layout} tied"] = list(pipe.tied)
    data_losses, data_state = runs["data"]
    result["names"] = sorted(k for k in data_state if k.startswith("params/"))
    for layout in layouts[1:]:
        losses, state = runs[layout]
        result[layout] = {
            "same_names": sorted(state) == sorted(data_state),
            "loss_dev": float(np.max(np.abs(losses - data_losses) / np.abs(data_losses))),
            "param_dev": max(float(np.max(np.abs(state[k] - data_state[k])))
                             for k in result["names"])}
    emit(result)


def process_sets(backend: str, stages: str) -> None:
    """See the module's docstring."""
    import adapters
    from toolkit.equivalence import load_data, make_optimizer
    from toolkit.models.reference import reference_run

    model = toolkit.GPT(vocab=256, context=16, width=32, layers=4, heads=2)
    x, y = load_data("gpt", "float64")
    opt, steps = make_optimizer("adam", 4), 4
    ref_losses, ref_params = reference_run(model, opt, "cross_entropy", x, y,
                                           global_batch_size=16, steps=steps, seed=0,
                                           dtype="float64")
    adapter = adapters.get(backend, dtype="float64")
    history = toolkit.Trainer(adapter, model, opt, layout=f"pipeline:{stages}:4",
                              global_batch_size=16, max_steps=steps, progress=False).fit(x, y)
    state, pipe = adapter.state_dict(), executor_of(adapter)
    losses = np.asarray(history.losses)
    result = {
        "rank": toolkit.current_env().rank, "position": list(adapter.pipeline_position()),
        "stage_set": pipe.stage_set.ranks if pipe.stage_set is not None else None,
        "ends_set": pipe.ends_set.ranks if pipe.ends_set is not None else None,
        "global_ends": pipe.ends_set is pipe.hvd.global_process_set,
        "loss_dev": float(np.max(np.abs(losses - ref_losses) / np.abs(ref_losses))),
        "param_dev": max(float(np.max(np.abs(state[f"params/{k}"] - v)))
                         for k, v in ref_params.items())}
    if int(stages) == 2 and toolkit.current_env().world_size == 4:
        try:  # 4 stages need the end stages' set {0, 3}, not registered at hvd.init
            toolkit.Trainer(adapters.get(backend, dtype="float64"), model, opt,
                            layout="pipeline:4:4", global_batch_size=16, max_steps=1,
                            progress=False).fit(x, y)
            result["second"] = "trained"
        except toolkit.ToolkitError as err:
            result["second"] = str(err)
        adapter.barrier()  # every rank has its answer before any exits (and stops Horovod)
    emit(result)


if __name__ == "__main__":
    modes = {"equivalence": equivalence, "bubble": bubble, "crash": crash,
             "keras": keras_sequential, "process_sets": process_sets, "tied": tied,
             "message_bytes": message_bytes}
    toolkit.run(lambda: modes[sys.argv[1]](*sys.argv[2:]))
