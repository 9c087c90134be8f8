"""Kill any job at any moment and resume it: same size (bit for bit), another world size,
another backend; plus the bad checkpoints a resume must refuse."""

import json

import numpy as np
import pytest

import adapters
import toolkit
from toolkit import CheckpointError, read_checkpoint
from toolkit.datasets import load_digits

SCRIPT = "tests/scripts/resumable.py"
STEPS, KILL_AT = 100, 60  # 22 steps per epoch: step 60 is in the middle of epoch 2 (from 0)
TOLERANCE = 1e-5
OTHER_BACKENDS = ["jax-pjit", "horovod-tf", "jax-pmap"]
IN_CI = {("horovod-torch", "horovod-tf"), ("horovod-torch", "jax-pjit"),
         ("jax-pmap", "horovod-torch")}


def launcher_for(nproc):
    return "python" if nproc == 1 else "any"


def train(launch, tmp, name, nproc=2, backend="horovod-torch", ckpt="ckpt", extra=()):
    args = [SCRIPT, "--backend", backend, "--steps", str(STEPS), "--checkpoint-dir",
            str(tmp / ckpt), "--save-model", str(tmp / f"{name}.npz"),
            "--metrics-log", str(tmp / f"{name}.jsonl"), *extra]
    return launch(launcher_for(nproc), nproc, args, timeout=300)


def params(path):
    with np.load(path) as f:
        return {k: f[k] for k in f.files if k.startswith("params/")}


def step_losses(read_metrics, path, first=KILL_AT + 1):
    steps = read_metrics(path)["steps"]
    return np.array([steps[k] for k in range(first, STEPS + 1)])


@pytest.fixture(scope="module")
def uninterrupted(launch, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("uninterrupted")
    job = train(launch, tmp, "ref")
    assert job.returncode == 0, job
    return tmp


def kill_then_resume(launch, tmp, save=(2, "horovod-torch"), resume=(2, "horovod-torch"),
                     extra=()):
    killed = train(launch, tmp, "killed", *save, extra=["--kill-after", str(KILL_AT), *extra])
    assert killed.returncode != 0, killed
    newest = toolkit.CheckpointStore(tmp / "ckpt").checkpoints()[-1]
    assert newest.name == f"step_{KILL_AT:09d}" and read_checkpoint(newest).step == KILL_AT
    resumed = train(launch, tmp, "resumed", *resume, extra=["--resume", "latest", *extra])
    assert resumed.returncode == 0, resumed
    assert f"resumed from {newest}" in resumed.stdout, resumed
    return resumed


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_same_backend_same_size_resumes_bit_for_bit(mode, launch, tmp_path, uninterrupted,
                                                    read_metrics):
    extra = ["--async-checkpoint"] if mode == "async" else []
    kill_then_resume(launch, tmp_path, extra=extra)
    ref, got = params(uninterrupted / "ref.npz"), params(tmp_path / "resumed.npz")
    assert ref.keys() == got.keys()
    for k in ref:
        assert np.array_equal(ref[k], got[k]), k
    assert np.array_equal(step_losses(read_metrics, tmp_path / "resumed.jsonl"),
                          step_losses(read_metrics, uninterrupted / "ref.jsonl"))


def assert_close_continuation(tmp_path, uninterrupted, read_metrics):
    ref = step_losses(read_metrics, uninterrupted / "ref.jsonl")
    got = step_losses(read_metrics, tmp_path / "resumed.jsonl")
    assert np.max(np.abs(got - ref) / np.abs(ref)) <= TOLERANCE
    ref_p, got_p = params(uninterrupted / "ref.npz"), params(tmp_path / "resumed.npz")
    assert max(np.max(np.abs(ref_p[k] - got_p[k])) for k in ref_p) <= TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("saved, resumed", [  # 2 -> 3 (sharded) is in tests/test_sharded.py
    (2, 1), pytest.param(2, 4, marks=pytest.mark.long), pytest.param(4, 2, marks=pytest.mark.long)])
def test_resume_on_another_world_size(saved, resumed, launch, tmp_path, uninterrupted,
                                      read_metrics):
    out = kill_then_resume(launch, tmp_path, save=(saved, "horovod-torch"),
                           resume=(resumed, "horovod-torch"))
    assert f"on {saved} ranks" in out.stdout
    assert_close_continuation(tmp_path, uninterrupted, read_metrics)


@pytest.mark.slow
@pytest.mark.parametrize("source, target", [  # every backend once in make test, all pairs long
    pytest.param(s, t, marks=[] if (s, t) in IN_CI else [pytest.mark.long])
    for s, t in [("horovod-torch", b) for b in OTHER_BACKENDS]
    + [(b, "horovod-torch") for b in OTHER_BACKENDS]])
def test_resume_in_another_backend(source, target, launch, tmp_path, uninterrupted,
                                   read_metrics):
    out = kill_then_resume(launch, tmp_path, save=(2, source), resume=(2, target))
    assert f"written by {source}" in out.stdout
    assert_close_continuation(tmp_path, uninterrupted, read_metrics)


# ------------------------------------------------------------------ bad checkpoints, in-process
def trainer(tmp_path, model=None, resume=None):
    return toolkit.Trainer(adapters.get("horovod-torch"), model or toolkit.MLP((64, 32, 10)),
                           toolkit.Adam(lr=1e-3), global_batch_size=32, max_steps=3,
                           checkpoint_dir=tmp_path / "ckpt", resume=resume, progress=False,
                           env=toolkit.LaunchEnv())


@pytest.fixture
def data():
    (x, y), _ = load_digits()
    return x, y


def test_checkpoint_of_another_model_is_refused_and_kept(tmp_path, data):
    trainer(tmp_path).fit(*data)
    before = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    with pytest.raises(CheckpointError) as err:
        trainer(tmp_path, toolkit.MLP((64, 16, 10)), resume="latest").fit(*data)
    assert "does not fit this model" in str(err.value)
    assert "wrong shape: params/layers.0.bias" in str(err.value)
    with pytest.raises(CheckpointError, match="missing: params/layers.2.bias"):
        trainer(tmp_path, toolkit.MLP((64, 32, 8, 10)), resume="latest").fit(*data)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == before


def test_explicit_path_without_a_checkpoint_is_an_error(tmp_path, data):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="manifest.json does not exist"):
        trainer(tmp_path, resume=tmp_path / "empty").fit(*data)


def test_unknown_format_version_is_an_error(tmp_path, data):
    trainer(tmp_path).fit(*data)
    path = toolkit.CheckpointStore(tmp_path / "ckpt").checkpoints()[-1]
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["format_version"] = 2
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="format version 2; this toolkit reads version 1"):
        trainer(tmp_path, resume=path).fit(*data)


def test_unwritable_checkpoint_directory_is_an_error(tmp_path, data):
    (tmp_path / "ckpt").write_text("a file where the directory should be")
    with pytest.raises(CheckpointError, match="could not write checkpoint"):
        trainer(tmp_path).fit(*data)


def test_manifest_records_what_a_resume_needs(tmp_path, data):
    trainer(tmp_path).fit(*data)
    ckpt = toolkit.CheckpointStore(tmp_path / "ckpt").load("latest")
    meta = ckpt.meta
    assert (meta["step"], meta["world_size"], meta["backend"]) == (3, 1, "horovod-torch")
    assert meta["sampler"]["step"] == 3 and meta["layout"] == "data_parallel"
    assert meta["model"] == {"type": "MLP", "sizes": [64, 32, 10], "activation": "relu"}
    assert meta["optimizer"]["type"] == "Adam" and int(ckpt.tensors["opt/count"]) == 3
