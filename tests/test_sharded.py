"""Sharded parameters (ZeRO 1-3 / FSDP): every stage equals data parallel, in every backend
that has the ability, at even and odd world sizes; each rank holds its share of the state;
sharded checkpoints resume bit for bit, and onto other world sizes, layouts and backends."""

import json
import shutil

import numpy as np
import pytest

import adapters
import toolkit
from toolkit import CheckpointError, read_checkpoint
from toolkit.datasets import load_digits
from toolkit.equivalence import LOSS_TOLERANCE, make_model
from toolkit.memory import estimate

SHARDED = [b for b in adapters.BACKENDS
           if isinstance(adapters.get(b), toolkit.ShardedAdapter)]
SCRIPT = "tests/scripts/resumable.py"
STEPS, KILL_AT, EVERY = 40, 20, 10
TOLERANCE = 1e-5


def equivalence(launch, tmp_path, *args):
    out = tmp_path / "eq.json"
    job = launch("python", 1, ["-m", "adapters.equivalence", "--json", str(out), *args],
                 timeout=900)
    assert out.exists(), job
    return job, json.loads(out.read_text())["results"]


def test_every_backend_has_the_sharded_ability():
    assert SHARDED == list(adapters.BACKENDS)


# Only jax-pjit splits layers (the GPT's, tests/adapters/test_sharded_jax.py); every other
# backend refuses tensor parallelism.
SPLITS_LAYERS = "jax-pjit"
REFUSE_TENSOR_PARALLEL = [b for b in adapters.BACKENDS if b != SPLITS_LAYERS]


@pytest.mark.parametrize("backend", REFUSE_TENSOR_PARALLEL)
def test_tensor_parallel_is_refused_where_layers_are_not_split(backend):
    trainer = toolkit.Trainer(adapters.get(backend), toolkit.MLP((64, 10)), toolkit.SGD(lr=0.1),
                              global_batch_size=4, layout="sharded:3:tp2", env=toolkit.LaunchEnv())
    with pytest.raises(toolkit.ToolkitError, match="tensor_parallel=2") as err:
        (x, y), _ = load_digits()
        trainer.fit(x[:8], y[:8])
    assert "jax-pjit" in str(err.value)


def test_jax_pjit_splits_the_gpt_and_refuses_tensor_parallel_for_other_models():
    """jax-pjit takes ``tensor_parallel=2`` for a toolkit.GPT (on the 2 local devices: each
    holds half of every split kernel, and the losses are the reference's), and refuses it for
    any other model with an error that names the GPT and the way out."""
    from toolkit.models.reference import reference_run

    assert SPLITS_LAYERS in adapters.BACKENDS
    (x, y), _ = load_digits()
    mlp = toolkit.Trainer(adapters.get(SPLITS_LAYERS), toolkit.MLP((64, 10)),
                          toolkit.SGD(lr=0.1), global_batch_size=4, layout="sharded:3:tp2",
                          env=toolkit.LaunchEnv(), progress=False)
    with pytest.raises(toolkit.ToolkitError, match=r"jax-pjit: tensor_parallel=2 splits the "
                       r"attention and MLP kernels of a toolkit\.GPT, not of MLP") as err:
        mlp.fit(x[:8], y[:8])
    assert "use tensor_parallel=1" in str(err.value)

    gpt = toolkit.GPT(vocab=32, context=8, width=16, layers=2, heads=2)
    tokens = np.random.default_rng(1).integers(0, 32, 16 * 8 + 1)
    xs, ys = tokens[:-1].reshape(16, 8), tokens[1:].reshape(16, 8)
    optimizer = toolkit.SGD(lr=0.1, momentum=0.9)
    adapter = adapters.get(SPLITS_LAYERS)
    trainer = toolkit.Trainer(adapter, gpt, optimizer, global_batch_size=8, max_steps=2,
                              layout="sharded:3:tp2", env=toolkit.LaunchEnv(), progress=False)
    history = trainer.fit(xs, ys)
    assert adapter.layout.tensor_parallel == 2
    fc = adapter.strategy.params["split"]["blocks.0.mlp.fc.kernel"]  # (4w, w) in 2 rows of halves
    assert [s.data.shape for s in fc.addressable_shards] == [(1, 4 * 16 * 16 // 2)] * 2
    ref_losses, _ = reference_run(gpt, optimizer, "cross_entropy", xs, ys,
                                  global_batch_size=8, steps=2, dtype="float64")
    np.testing.assert_allclose(history.losses, ref_losses, rtol=LOSS_TOLERANCE["float32"])


# Every stage at 2 and 3 ranks (3: uneven shards, the padding lies in the last rank's shard),
# the three stages one after another in each launch. AdamW exercises every optimizer slot and
# the decoupled decay.
@pytest.mark.slow
@pytest.mark.parametrize("backend", SHARDED)
def test_every_stage_equals_the_reference(backend, launch, tmp_path):
    layouts = ["sharded:1", "sharded:2", "sharded:3"]
    job, rows = equivalence(launch, tmp_path, "--backends", backend, "--layout",
                            ",".join(layouts), "--world-sizes", "2,3", "--steps", "20",
                            "--batch-size", "48", "--optimizer", "adamw")
    assert job.returncode == 0, job
    assert sorted((r["world_size"], r["layout"]) for r in rows) == [
        (w, layout) for w in (2, 3) for layout in layouts]
    for row in rows:
        assert row["status"] == "pass", row
        assert row["max_rel_loss_dev"] <= LOSS_TOLERANCE["float32"], row


def replicated_bytes(model_name: str, slots: int) -> int:
    """What one data-parallel rank holds: parameters, their gradients and ``slots`` optimizer
    slots, from the sizes of the spec's real initial arrays (float32)."""
    params = sum(a.nbytes for a in make_model(model_name).init(0, "float32").values())
    return params * (2 + slots)


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize("backend", SHARDED)
def test_fsdp_gpt_at_an_odd_world_size_and_its_memory(backend, launch, tmp_path):
    """Stage 3 on the GPT over 3 ranks (uneven shards) equals the reference, and each rank
    holds a third of the replicated state: what the estimator predicts, within 5%."""
    job, rows = equivalence(launch, tmp_path, "--backends", backend, "--model", "gpt",
                            "--layout", "sharded:3", "--world-sizes", "3", "--steps", "10",
                            "--batch-size", "48")
    assert job.returncode == 0, job
    (row,) = rows
    assert row["status"] == "pass", row
    whole = replicated_bytes("gpt", slots=1)  # SGD with momentum: one slot
    held = row["state_bytes_per_rank"]
    # Padding to a multiple of 3 is at most 2 elements per unit (and per device for JAX).
    assert whole / 3 <= held <= 1.05 * whole / 3, (held, whole)
    predicted = estimate(make_model("gpt").num_params, toolkit.Sharded(3), 3,
                         optimizer="momentum").model_states
    assert abs(held - predicted) <= 0.05 * predicted, (held, predicted)


# ------------------------------------------------------------------ sharded checkpoints
def train(launch, tmp, name, nproc, backend, layout, extra=()):
    args = [SCRIPT, "--backend", backend, "--steps", str(STEPS), "--layout", layout,
            "--checkpoint-every", str(EVERY), "--checkpoint-dir", str(tmp / "ckpt"),
            "--batch-size", "48",  # divides over 2 and 3 ranks
            "--save-model", str(tmp / f"{name}.npz"), "--metrics-log",
            str(tmp / f"{name}.jsonl"), *extra]
    return launch("any" if nproc > 1 else "python", nproc, args, timeout=300)


def saved_params(path):
    with np.load(path) as f:
        return {k: f[k] for k in f.files if k.startswith("params/")}


def losses_after_kill(read_metrics, path):
    steps = read_metrics(path)["steps"]
    return np.array([steps[k] for k in range(KILL_AT + 1, STEPS + 1)])


@pytest.fixture(scope="module")
def uninterrupted(launch, tmp_path_factory):
    """``uninterrupted(backend)``: the folder of one uninterrupted sharded:3 run on 2 ranks."""
    done = {}

    def get(backend):
        if backend not in done:
            tmp = tmp_path_factory.mktemp(f"uninterrupted-{backend}")
            job = train(launch, tmp, "ref", 2, backend, "sharded:3")
            assert job.returncode == 0, job
            done[backend] = tmp
        return done[backend]

    return get


def kill_then_resume(launch, tmp, source, target, extra=()):
    """Trains ``source = (nproc, backend, layout)`` until it dies after the checkpoint of step
    KILL_AT, then resumes as ``target`` (``extra``: more arguments for both); returns the
    resumed job."""
    killed = train(launch, tmp, "killed", *source, extra=["--kill-after", str(KILL_AT), *extra])
    assert killed.returncode != 0, killed
    newest = toolkit.CheckpointStore(tmp / "ckpt").checkpoints()[-1]
    ckpt = read_checkpoint(newest)
    assert ckpt.step == KILL_AT and ckpt.meta["layout"] == source[2]
    # Every rank wrote its own pieces: nothing was gathered onto rank 0.
    assert ckpt.meta["shard_ranks"] == source[0]
    assert len({p.name[:12] for p in newest.glob("shard-r*.npy")}) == source[0]
    resumed = train(launch, tmp, "resumed", *target, extra=["--resume", "latest", *extra])
    assert resumed.returncode == 0, resumed
    assert f"resumed from {newest}" in resumed.stdout, resumed
    return resumed


@pytest.mark.slow
@pytest.mark.parametrize("backend", [
    b if b in ("horovod-torch", "jax-pjit") else pytest.param(b, marks=pytest.mark.long)
    for b in SHARDED])
def test_sharded_kill_and_resume_is_bit_for_bit(backend, launch, tmp_path, uninterrupted,
                                               read_metrics):
    kill_then_resume(launch, tmp_path, (2, backend, "sharded:3"), (2, backend, "sharded:3"))
    ref, got = saved_params(uninterrupted(backend) / "ref.npz"), saved_params(
        tmp_path / "resumed.npz")
    assert ref.keys() == got.keys()
    for k in ref:
        assert np.array_equal(ref[k], got[k]), k
    assert np.array_equal(losses_after_kill(read_metrics, tmp_path / "resumed.jsonl"),
                          losses_after_kill(read_metrics, uninterrupted(backend) / "ref.jsonl"))


def _moves():
    """(source, target) resumes: another world size, data parallel, another stage and
    backend. Only between backends that have the ability; the cross-backend ones are long."""
    cases = [(("horovod-torch", "sharded:3", 2), ("horovod-torch", "sharded:3", 3)),
             (("horovod-torch", "sharded:3", 2), ("horovod-torch", "data", 2)),
             (("jax-pjit", "sharded:3", 2), ("horovod-tf", "sharded:2", 2)),
             (("horovod-tf", "sharded:3", 2), ("jax-pmap", "sharded:1", 3))]
    return [pytest.param((s[2], s[0], s[1]), (t[2], t[0], t[1]),
                         id=f"{s[0]}-{s[1]}x{s[2]}-to-{t[0]}-{t[1]}x{t[2]}",
                         marks=[pytest.mark.long] if s[0] != t[0] else [])
            for s, t in cases if s[0] in SHARDED and t[0] in SHARDED]


@pytest.mark.slow
@pytest.mark.parametrize("source, target", _moves())
def test_sharded_checkpoint_resumes_elsewhere(source, target, launch, tmp_path, uninterrupted,
                                             read_metrics):
    out = kill_then_resume(launch, tmp_path, source, target)
    assert f"written by {source[1]} on {source[0]} ranks" in out.stdout
    ref_dir = uninterrupted(source[1])
    ref = losses_after_kill(read_metrics, ref_dir / "ref.jsonl")
    got = losses_after_kill(read_metrics, tmp_path / "resumed.jsonl")
    assert np.max(np.abs(got - ref) / np.abs(ref)) <= TOLERANCE
    ref_p, got_p = saved_params(ref_dir / "ref.npz"), saved_params(tmp_path / "resumed.npz")
    assert max(np.max(np.abs(ref_p[k] - got_p[k])) for k in ref_p) <= TOLERANCE

    # A missing shard file is an error naming it; "latest" falls back to an intact one.
    store = toolkit.CheckpointStore(tmp_path / "ckpt")
    # (the newest one with pieces of rank 1: a data-parallel target writes none)
    newest = [c for c in store.checkpoints() if list(c.glob("shard-r00001-*.npy"))][-1]
    piece = sorted(newest.glob("shard-r00001-*.npy"))[0]
    piece.unlink()
    with pytest.raises(CheckpointError, match=piece.name):
        read_checkpoint(newest)
    assert store.load("latest").path != newest
    shutil.rmtree(tmp_path / "ckpt")
