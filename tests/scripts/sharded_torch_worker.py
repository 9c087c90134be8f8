"""Multi-rank checks of horovod-torch's sharded layouts; reports one result per rank (_emit).

    horovodrun -np 3 --gloo python tests/scripts/sharded_torch_worker.py collectives
    horovodrun -np 3 --gloo python tests/scripts/sharded_torch_worker.py layouts

``collectives``: Horovod's reduce-scatter (average) and all-gather, plain and grouped, on
buffers of more than 1 MiB per rank, against numpy; then the backend's own gather/reduce-scatter
autograd function on a 1024x1024 dense layer (1.4 MB per rank at 3 ranks): forward values and
the reduce-scattered gradient shard against numpy.

``layouts``: a small GPT trained under data parallel and stages 1-3 (Adam, two micro-batches,
a custom loss and a custom metric): losses and evaluation agree; ``memory_bytes()`` equals the
FlatLayout arithmetic; a stage-3 checkpoint's pieces load back as the full state.
"""

import shutil
import sys
import tempfile

import numpy as np
from _emit import emit

import adapters
import toolkit
from toolkit.checkpoint.store import CheckpointStore, read_checkpoint
from toolkit.equivalence import _comparable
from toolkit.parallel.shards import unit_layouts

CHUNK = 300_000  # float32 elements per rank: 1.2 MB


def check(label: str, got, want, results: dict, rtol: float = 1e-6) -> None:
    """Max deviation relative to the largest expected magnitude, recorded and bounded."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (label, got.shape, want.shape)
    err = float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))
    results[label] = err
    assert err <= rtol, (label, err)


def collectives() -> dict:
    import torch

    adapter = adapters.get("horovod-torch")
    adapter.setup(toolkit.current_env())
    hvd = adapter.runtime.hvd
    rank, size = hvd.rank(), hvd.size()
    results: dict = {}

    def rank_data(r, n, dtype, salt=0):  # integers: sums are exact in float32
        return np.random.default_rng([r, salt]).integers(-1000, 1000, n).astype(dtype)

    for dtype in (np.float32, np.float64):
        n = CHUNK * size
        mine = rank_data(rank, n, dtype)
        mean = sum(rank_data(r, n, np.float64) for r in range(size)) / size
        own = slice(rank * CHUNK, (rank + 1) * CHUNK)
        name = np.dtype(dtype).name
        out = hvd.reducescatter(torch.from_numpy(mine), op=hvd.Average)
        check(f"reducescatter.{name}", out.numpy(), mean[own], results)
        out = hvd.allgather(torch.from_numpy(mine[own].copy()))
        want = np.concatenate([rank_data(r, n, dtype)[r * CHUNK:(r + 1) * CHUNK]
                               for r in range(size)])
        check(f"allgather.{name}", out.numpy(), want, results, rtol=0.0)
    # grouped, as stages 1 and 2 use them: two buffers of different lengths in one call
    sizes = (CHUNK * size, (CHUNK + 7) * size)
    mine = [rank_data(rank, n, np.float32, salt) for salt, n in enumerate(sizes)]
    outs = hvd.grouped_reducescatter([torch.from_numpy(a) for a in mine], op=hvd.Average)
    for salt, (n, out) in enumerate(zip(sizes, outs, strict=True)):
        mean = sum(rank_data(r, n, np.float64, salt) for r in range(size)) / size
        per = n // size
        check(f"grouped_reducescatter.{salt}", out.numpy(), mean[rank * per:(rank + 1) * per],
              results)
    outs = hvd.grouped_allgather([torch.from_numpy(a[:n // size].copy())
                                  for a, n in zip(mine, sizes, strict=True)])
    for salt, (n, out) in enumerate(zip(sizes, outs, strict=True)):
        want = np.concatenate([rank_data(r, n, np.float32, salt)[:n // size]
                               for r in range(size)])
        check(f"grouped_allgather.{salt}", out.numpy(), want, results, rtol=0.0)

    # The backend's own mechanism: FSDP (stage 3) on one 1024 -> 1024 dense layer.
    spec = toolkit.MLP((1024, 1024))
    adapter.setup(toolkit.current_env(), toolkit.Sharded(3))  # a new layout, the same runtime
    adapter.build(spec, toolkit.SGD(lr=0.0), "mse", seed=0)
    init = spec.init(0)
    (fl,) = unit_layouts({k: v.shape for k, v in init.items()}, size).values()
    assert fl.shard_size * 4 > 2**20, fl.shard_size  # more than 1 MiB per rank
    x = [np.random.default_rng([9, r]).normal(size=(4, 1024)).astype(np.float32)
         for r in range(size)]
    shards = adapter.strategy.shards
    shards.zero_grad()
    with shards.forwarding():
        out = adapter.strategy.net(torch.from_numpy(x[rank]))
        loss = out.sum()
    check("fsdp.forward", out.detach().numpy(),
          x[rank] @ init["layers.0.kernel"] + init["layers.0.bias"], results, rtol=1e-5)
    loss.backward()
    # d(sum(x @ k + b)) / dk = x^T @ ones, / db = batch: averaged over ranks, then sharded.
    grads = {"layers.0.kernel": np.mean([xr.sum(0)[:, None] * np.ones((1, 1024)) for xr in x],
                                        axis=0),
             "layers.0.bias": np.full(1024, 4.0)}
    check("fsdp.reducescatter_backward", shards.grads[0].numpy(), fl.shard(grads, rank),
          results, rtol=1e-5)
    assert shards.grads[0].numel() == fl.shard_size  # a shard, not a full gradient
    return results


def layouts() -> dict:
    import torch

    spec = toolkit.GPT(vocab=32, context=8, width=16, layers=3, heads=2)
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 32, (96, 8)), rng.integers(0, 32, (96, 8))
    results: dict = {}
    runs = {}

    def custom_loss(out, labels):  # per-sample mean token cross-entropy, written by hand
        logp = torch.log_softmax(out, dim=-1)
        return -logp.gather(-1, labels[..., None]).squeeze(-1).mean(dim=1)

    def top_logit(out, labels):
        return out.max(dim=-1).values.mean(dim=1)

    for layout in (toolkit.DataParallel(), *(toolkit.Sharded(s) for s in (1, 2, 3))):
        adapter = adapters.get("horovod-torch")
        trainer = toolkit.Trainer(
            adapter, spec, toolkit.Adam(lr=1e-2, weight_decay=0.01, decoupled=True),
            loss=custom_loss, metrics={"top": top_logit}, layout=layout,
            global_batch_size=24, max_steps=4, accumulation_steps=2, progress=False)
        history = trainer.fit(x, y)
        val = trainer.evaluate(x[:40], y[:40])
        runs[layout.name] = (history.losses, val, adapter.state_dict(), adapter.memory_bytes())
        if isinstance(layout, toolkit.Sharded):
            check_memory(adapter, spec, layout.stage, results)
            check_pieces(adapter, results)
    base_losses, base_val, base_state, _ = runs["data_parallel"]
    for name, (losses, val, state, _) in runs.items():
        check(f"{name}.losses", losses, base_losses, results, rtol=1e-5)
        check(f"{name}.val", [val["val_loss"], val["val_top"]],
              [base_val["val_loss"], base_val["val_top"]], results, rtol=1e-5)
        assert state.keys() == base_state.keys(), (name, state.keys() ^ base_state.keys())
        for key in base_state:  # (the key bias's gradient is rounding noise: left out)
            check(f"{name}.{key}", _comparable(key, state[key]),
                  _comparable(key, base_state[key]), results, rtol=1e-4)
    results["memory"] = {name: run[3] for name, run in runs.items()}
    return results


def check_memory(adapter, spec, stage: int, results: dict) -> None:
    """memory_bytes() (summed from the real buffers) against FlatLayout arithmetic."""
    size = adapter.runtime.hvd.size()
    fls = unit_layouts(spec.param_shapes(), size).values()
    padded = sum(fl.padded for fl in fls) * 4
    shard = sum(fl.shard_size for fl in fls) * 4
    want = {"params": padded if stage < 3 else shard,
            "grads": padded if stage == 1 else shard,
            "optimizer": 2 * shard}  # Adam's mu and nu
    got = adapter.memory_bytes()
    assert got == want, (stage, got, want)
    results[f"memory.{stage}"] = got


def check_pieces(adapter, results: dict) -> None:
    """Every rank has a piece of every sharded tensor; in rank order they make the full one;
    and a checkpoint written from them reads back as the full state."""
    import torch

    hvd = adapter.runtime.hvd
    full = adapter.state_dict()
    replicated, pieces = adapter.sharded_state()
    assert not set(replicated) & set(pieces)
    assert set(replicated) | set(pieces) == set(full), set(full) ^ (set(replicated)
                                                                   | set(pieces))
    for name, (piece, axis, shape) in pieces.items():
        assert axis == 0 and tuple(shape) == full[name].shape, name
        joined = hvd.allgather(torch.from_numpy(np.ascontiguousarray(piece)),
                               name=f"test.{name}").numpy()
        np.testing.assert_array_equal(joined.reshape(shape), full[name])
    # (broadcast_object names the operation after the type unless told: None != str)
    directory = hvd.broadcast_object(tempfile.mkdtemp() if hvd.rank() == 0 else None, 0,
                                     name="directory")
    store = CheckpointStore(directory, rank=hvd.rank())
    path = hvd.broadcast_object(store.save(7, replicated, {"note": "test"}, shards=pieces,
                                           barrier=adapter.barrier), 0, name="path")
    ckpt = read_checkpoint(path)
    assert set(ckpt.tensors) == set(full)
    for name, value in full.items():
        np.testing.assert_array_equal(ckpt.tensors[name], value)
    adapter.barrier()
    if hvd.rank() == 0:
        shutil.rmtree(directory)
    results[f"pieces.{adapter.layout.stage}"] = len(pieces)


if __name__ == "__main__":
    mode = sys.argv[1]
    out = {"collectives": collectives, "layouts": layouts}[mode]()
    emit({"rank": toolkit.current_env().rank, **out})
