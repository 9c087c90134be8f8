"""Kill-and-resume of the GPT: bit for bit at the same size and backend, within the
equivalence bounds on another world size and in another backend."""

import numpy as np
import pytest

import toolkit
from toolkit import read_checkpoint

SCRIPT = "tests/scripts/resumable.py"
STEPS, KILL_AT = 40, 20
TOLERANCE = 1e-5


def train(launch, tmp, name, nproc=2, backend="horovod-torch", extra=()):
    args = [SCRIPT, "--model", "gpt", "--backend", backend, "--steps", str(STEPS),
            "--checkpoint-dir", str(tmp / "ckpt"), "--save-model", str(tmp / f"{name}.npz"),
            "--metrics-log", str(tmp / f"{name}.jsonl"), *extra]
    return launch("python" if nproc == 1 else "any", nproc, args, timeout=300)


def params(path):
    with np.load(path) as f:
        return {k: f[k] for k in f.files if k.startswith("params/")}


def losses(read_metrics, path):
    steps = read_metrics(path)["steps"]
    return np.array([steps[k] for k in range(KILL_AT + 1, STEPS + 1)])


@pytest.fixture(scope="module")
def uninterrupted(launch, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpt-uninterrupted")
    job = train(launch, tmp, "ref")
    assert job.returncode == 0, job
    return tmp


def kill_then_resume(launch, tmp, save, resume):
    killed = train(launch, tmp, "killed", *save, extra=["--kill-after", str(KILL_AT)])
    assert killed.returncode != 0, killed
    newest = toolkit.CheckpointStore(tmp / "ckpt").checkpoints()[-1]
    assert read_checkpoint(newest).step == KILL_AT
    assert read_checkpoint(newest).meta["model"]["type"] == "GPT"
    resumed = train(launch, tmp, "resumed", *resume, extra=["--resume", "latest"])
    assert resumed.returncode == 0, resumed
    assert f"resumed from {newest}" in resumed.stdout, resumed


@pytest.mark.slow
def test_gpt_resumes_bit_for_bit(launch, tmp_path, uninterrupted, read_metrics):
    kill_then_resume(launch, tmp_path, (2, "horovod-torch"), (2, "horovod-torch"))
    ref, got = params(uninterrupted / "ref.npz"), params(tmp_path / "resumed.npz")
    assert ref.keys() == got.keys() and "params/blocks.1.attn.qkv.kernel" in ref
    for k in ref:
        assert np.array_equal(ref[k], got[k]), k
    assert np.array_equal(losses(read_metrics, tmp_path / "resumed.jsonl"),
                          losses(read_metrics, uninterrupted / "ref.jsonl"))


@pytest.mark.slow
@pytest.mark.parametrize("resume", [(1, "horovod-torch"), (2, "jax-pjit"),
                                    pytest.param((2, "horovod-tf"), marks=pytest.mark.long)],
                         ids=["one-rank", "jax-pjit", "horovod-tf"])
def test_gpt_resumes_on_another_size_or_backend(resume, launch, tmp_path, uninterrupted,
                                                read_metrics):
    kill_then_resume(launch, tmp_path, (2, "horovod-torch"), resume)
    ref = losses(read_metrics, uninterrupted / "ref.jsonl")
    got = losses(read_metrics, tmp_path / "resumed.jsonl")
    assert np.max(np.abs(got - ref) / np.abs(ref)) <= TOLERANCE
    ref_p, got_p = params(uninterrupted / "ref.npz"), params(tmp_path / "resumed.npz")
    # The key part of the qkv bias has zero gradient; Adam turns its rounding noise into
    # +-lr steps that do not change the function (see the conformance tests): leave it out.
    for k in ref_p:
        a, b = ref_p[k], got_p[k]
        if k.endswith("attn.qkv.bias"):
            a, b = np.delete(a, np.s_[32:64]), np.delete(b, np.s_[32:64])
        assert np.max(np.abs(a - b)) <= TOLERANCE, k
