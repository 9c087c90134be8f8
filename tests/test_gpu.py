"""On a GPU (``make test-gpu``; elsewhere each test is reported as skipped, with the reason):
every backend computes on it, equals the float64 reference there, keeps its state there, and
its checkpoints move between the GPU and the CPU."""

import json

import numpy as np
import pytest

from toolkit.equivalence import LOSS_TOLERANCE

BACKENDS = ["horovod-torch", "horovod-tf", "jax-pmap", "jax-pjit"]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_world_size_1_on_the_gpu_equals_the_float64_reference(launch, tmp_path, backend):
    """Float32 in full precision (no TF32) within 1e-5 of the reference, for data parallel and
    ZeRO-3 (a pipeline needs a GPU per stage), the CNN with AdamW and clipping."""
    out = tmp_path / "eq.json"
    job = launch("python", 1, ["-m", "adapters.equivalence", "--backends", backend,
                               "--world-sizes", "1", "--layout", "data,sharded:3",
                               "--model", "cnn", "--optimizer", "adamw", "--steps", "30",
                               "--clip-grad-norm", "1.0", "--device", "gpu", "--json", str(out)],
                 timeout=900)
    rows = json.loads(out.read_text())["results"]
    if all(r["status"] == "skipped" and "not importable" in r.get("reason", "") for r in rows):
        pytest.skip(f"{backend}'s framework is not installed here: {rows[0]['reason']}")
    assert job.returncode == 0, job
    for r in rows:
        assert r["status"] == "pass", r
        assert r["device"].startswith("gpu:"), r
        assert r["max_rel_loss_dev"] <= LOSS_TOLERANCE["float32"], r


@pytest.mark.parametrize("device", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("layout", ["data", "sharded:1", "sharded:3"])
def test_horovod_torch_keeps_every_tensor_on_the_rank_s_device(layout, device):
    """(On the CPU: the same checks, and the batch is left as it is.)"""
    import torch

    import adapters
    import toolkit

    adapter = adapters.get("horovod-torch")
    adapter.setup(toolkit.LaunchEnv(), toolkit.parse_layout(layout), device=device)
    adapter.build(toolkit.MLP((8, 16, 4)), toolkit.Adam(lr=1e-2), "cross_entropy",
                  clip_grad_norm=1.0)
    strategy = adapter.strategy
    x = np.random.default_rng(0).normal(size=(32, 8)).astype(np.float32)
    y = np.arange(32) % 4
    staged = adapter.device_batch(x, y)  # on a GPU: copied on the copy stream, from pinned
    if device == "gpu":  # memory
        assert staged[0].tensor.is_cuda and len(staged[0]) == 32
        where = torch.device("cuda", 0)
    else:
        assert staged[0] is x and staged[1] is y
        where = torch.device("cpu")
    loss = float(adapter.train_step(*staged, lr=1e-2))
    assert np.isfinite(loss) and adapter.device_names() == [f"{device}:0" if device == "gpu"
                                                             else "cpu"]
    if layout == "data":
        held = [p for _, p, _, _ in strategy.params]
        held += [v for s in strategy.opt.state.values() for v in s.values()
                 if torch.is_tensor(v) and v.dim()]
        # torch's fused AdamW on a GPU, its default on the CPU
        assert bool(strategy.opt.param_groups[0]["fused"]) == (device == "gpu")
    else:
        shards = strategy.shards
        held = [*shards.sources, *shards.grads, *(t for s in shards.slots for t in s.values())]
    assert len(held) >= 4 and all(t.device == where for t in held)
    # the staged batch and the host arrays take the same step
    state = adapter.state_dict()
    again = float(adapter.train_step(x, y, lr=1e-2))
    adapter.load_state_dict(state)
    assert float(adapter.train_step(*adapter.device_batch(x, y), lr=1e-2)) == again


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["horovod-torch", "jax-pjit"])
def test_a_gpu_checkpoint_resumes_on_the_cpu_and_back(launch, tmp_path, read_metrics, backend):
    """Checkpoints hold host arrays: 5 steps on one device and 5 resumed on the other follow
    the 10 steps of one device within the equivalence bound, and bit for bit on the same
    device (full float32 matmuls and deterministic GPU kernels, as the equivalence runs)."""
    exact = {"JAX_DEFAULT_MATMUL_PRECISION": "highest", "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
             "XLA_FLAGS": "--xla_gpu_deterministic_ops=true"}

    def run(device: str, steps: int, name: str, resume: bool = False) -> dict:
        job = launch("python", 1, ["examples/train_digits.py", "--backend", backend,
                                   "--device", device, "--steps", str(steps),
                                   "--optimizer", "adam", "--lr", "0.01",
                                   "--checkpoint-dir", str(tmp_path / name),
                                   "--checkpoint-every", "5",
                                   "--metrics-log", str(tmp_path / f"{name}-{steps}.jsonl"),
                                   *(["--resume", "latest"] if resume else [])], timeout=600,
                     env=exact)
        assert job.returncode == 0, job
        return read_metrics(tmp_path / f"{name}-{steps}.jsonl")["steps"]

    whole = {d: run(d, 10, f"{d}-whole") for d in ("cpu", "gpu")}
    for first, then in (("gpu", "cpu"), ("cpu", "gpu"), ("gpu", "gpu")):
        name = f"{first}-{then}"
        run(first, 5, name)
        resumed = run(then, 10, name, resume=True)
        assert sorted(resumed) == list(range(6, 11)), resumed
        expected = [whole[then][s] for s in range(6, 11)]
        got = [resumed[s] for s in range(6, 11)]
        if first == then:
            assert got == expected, name
        else:
            np.testing.assert_allclose(got, expected, rtol=LOSS_TOLERANCE["float32"])
