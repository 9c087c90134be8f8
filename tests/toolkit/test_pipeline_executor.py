"""The schedules are enough to execute: a numpy executor, one thread per stage, each a small loop
over its stage's action list, trains a cut MLP to the same loss and gradients as the whole model.

This is the shape a backend's executor takes (its sends and receives are collectives instead of
queues); the test proves the data tells each stage everything it needs, in an order that runs.
"""

from __future__ import annotations

import queue
import threading

import numpy as np
import pytest

from toolkit.models.specs import MLP, _loss_grad
from toolkit.parallel.pipeline.partition import partition_model
from toolkit.parallel.pipeline.schedules import pipeline_schedule

SPEC = MLP((6, 8, 8, 8, 3), activation="tanh")


def _forward(params, layers, x, last_layer):
    cache = []
    for i in layers:
        z = x @ params[f"layers.{i}.kernel"] + params[f"layers.{i}.bias"]
        cache.append((x, z))
        x = z if i == last_layer else np.tanh(z)
    return x, cache


def _backward(params, layers, cache, dout, last_layer, grads):
    for i, (x, z) in zip(reversed(layers), reversed(cache), strict=True):
        dz = dout if i == last_layer else dout * (1 - np.tanh(z) ** 2)
        grads[f"layers.{i}.kernel"] = grads.get(f"layers.{i}.kernel", 0) + x.T @ dz
        grads[f"layers.{i}.bias"] = grads.get(f"layers.{i}.bias", 0) + dz.sum(0)
        dout = dz @ params[f"layers.{i}.kernel"].T
    return dout


def _run_pipeline(schedule, params, x, y):
    S, M, v = schedule.stages, schedule.micro_batches, schedule.chunks
    part = partition_model(SPEC, S, v)
    last_layer, V = SPEC.num_layers - 1, S * v
    xs, ys = np.split(x, M), np.split(y, M)
    channels = {(a, b): queue.Queue() for a in range(S) for b in range(S)}
    grads = [{} for _ in range(S)]
    losses = [[] for _ in range(S)]
    errors = []

    def stage_loop(s):
        outs, dxs, inputs, douts, caches = {}, {}, {}, {}, {}
        for a in schedule.actions[s]:
            m, c = a.micro_batch, a.chunk
            vs = c * S + s
            if a.kind in ("SEND_F", "SEND_B"):
                peer_chunk = schedule.neighbour(a.kind, s, c)[1]
                data = outs.pop((m, c)) if a.kind == "SEND_F" else dxs.pop((m, c))
                channels[(s, a.peer)].put((a.kind[-1], m, peer_chunk, data))
            elif a.kind in ("RECV_F", "RECV_B"):
                kind, got_m, got_c, data = channels[(a.peer, s)].get(timeout=10)
                assert (kind, got_m, got_c) == (a.kind[-1], m, c), f"stage {s} at {a}"
                (inputs if kind == "F" else douts)[(m, c)] = data
            elif a.kind == "F":
                if vs == 0:
                    inp = xs[m]
                else:
                    inp = inputs.pop((m, c)) if (m, c) in inputs else outs.pop((m, c - 1))
                out, caches[(m, c)] = _forward(params, part.layers[vs], inp, last_layer)
                if vs == V - 1:  # the loss: the mean over the batch is the mean of M means
                    loss, dout = _loss_grad(out, ys[m], "cross_entropy")
                    losses[s].append(loss / M)
                    douts[(m, c)] = dout / M
                else:
                    outs[(m, c)] = out
            else:
                dout = douts.pop((m, c)) if (m, c) in douts else dxs.pop((m, c + 1))
                dxs[(m, c)] = _backward(params, part.layers[vs], caches.pop((m, c)), dout,
                                        last_layer, grads[s])
        assert not (outs or inputs or douts or caches), f"stage {s} left work undone"

    def guarded(s):
        try:
            stage_loop(s)
        except BaseException as err:  # reported below: a thread's failure must fail the test
            errors.append(err)

    threads = [threading.Thread(target=guarded, args=(s,)) for s in range(S)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    merged = {k: g for stage in grads for k, g in stage.items()}
    return sum(sum(ls) for ls in losses), merged


@pytest.mark.parametrize("name, stages, micro, chunks", [
    ("gpipe", 2, 4, 1), ("1f1b", 2, 4, 1), ("1f1b", 4, 8, 1), ("gpipe", 3, 2, 1),
    ("interleaved-1f1b", 2, 4, 2), ("interleaved-1f1b", 1, 2, 4), ("1f1b", 1, 3, 1),
])
def test_threaded_executor_matches_the_whole_model(name, stages, micro, chunks):
    rng = np.random.default_rng(0)
    params = SPEC.init(seed=1, dtype="float64")
    x, y = rng.normal(size=(24, 6)), rng.integers(0, 3, 24)
    schedule = pipeline_schedule(name, stages, micro, chunks)
    loss, grads = _run_pipeline(schedule, params, x, y)
    want_loss, want = SPEC.loss_and_grads(params, x, y)
    assert loss == pytest.approx(want_loss, rel=1e-12)
    assert sorted(grads) == sorted(want)
    for k in want:
        np.testing.assert_allclose(grads[k], want[k], rtol=1e-10, atol=1e-12)
