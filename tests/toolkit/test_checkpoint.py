"""The checkpoint store: atomic, verified, pruned, and honest about damage."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from toolkit import CheckpointError, CheckpointStore, read_checkpoint


def tensors(seed=0):
    rng = np.random.default_rng(seed)
    return {"params/w": rng.normal(size=(4, 3)).astype(np.float32),
            "params/b": rng.normal(size=(3,)),
            "opt/count": np.asarray(7, np.int64)}


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k


def test_round_trip_is_bit_exact_with_metadata(tmp_path):
    store = CheckpointStore(tmp_path)
    path = store.save(10, tensors(), {"epoch": 1, "sampler": {"step": 3}})
    assert path.name == "step_000000010"
    ckpt = store.load("latest")
    assert_same(ckpt.tensors, tensors())
    assert ckpt.step == 10 and ckpt.meta["sampler"] == {"step": 3}
    assert (tmp_path / "latest").read_text().strip() == "step_000000010"
    assert read_checkpoint(path).step == 10


def test_only_rank_0_writes(tmp_path):
    assert CheckpointStore(tmp_path, rank=1).save(1, tensors(), {}) is None
    assert not tmp_path.joinpath("step_000000001").exists()


def test_keeps_the_last_k(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    for step in (1, 2, 3, 4):
        store.save(step, tensors(step), {})
    assert [p.name for p in store.checkpoints()] == ["step_000000003", "step_000000004"]
    assert_same(store.load("latest").tensors, tensors(4))
    with pytest.raises(CheckpointError, match="keep=0"):
        CheckpointStore(tmp_path, keep=0)


@pytest.mark.parametrize("damage", ["truncate", "flip", "manifest", "version"])
def test_damage_is_detected_and_latest_falls_back(tmp_path, damage, capsys):
    store = CheckpointStore(tmp_path, keep=5)
    store.save(1, tensors(1), {})
    newest = store.save(2, tensors(2), {})
    data_file = newest / "00000.npy"
    if damage == "truncate":
        data_file.write_bytes(data_file.read_bytes()[:-7])
    elif damage == "flip":
        raw = bytearray(data_file.read_bytes())
        raw[-1] ^= 0xFF
        data_file.write_bytes(bytes(raw))
    elif damage == "manifest":
        (newest / "manifest.json").write_text('{"format": "hpc-tool')
    else:
        manifest = json.loads((newest / "manifest.json").read_text())
        manifest["format_version"] = 99
        (newest / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError) as err:
        read_checkpoint(newest)
    expected = {"truncate": "00000.npy", "flip": "fails its checksum",
                "manifest": "manifest.json", "version": "format version 99"}[damage]
    assert expected in str(err.value) and "HINT:" in str(err.value)
    fallback = store.load("latest")
    assert fallback.step == 1
    assert_same(fallback.tensors, tensors(1))
    assert "skipped damaged checkpoint" in capsys.readouterr().err


def test_no_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        CheckpointStore(tmp_path).load("latest")
    with pytest.raises(CheckpointError, match="does not exist"):
        read_checkpoint(tmp_path)


def test_unwritable_directory_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(CheckpointError, match="could not write checkpoint"):
        CheckpointStore(blocker / "ckpt").save(1, tensors(), {})


def test_full_disk_keeps_the_previous_checkpoint(tmp_path):
    """A real write failure (RLIMIT_FSIZE: the kernel refuses to grow files past 64 KiB)."""
    store = CheckpointStore(tmp_path)
    store.save(1, tensors(), {})
    script = textwrap.dedent(f"""
        import resource, signal, sys
        import numpy as np
        from toolkit import CheckpointStore, CheckpointError
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
        try:
            CheckpointStore({str(tmp_path)!r}).save(2, {{"big": np.zeros(100_000)}}, {{}})
        except CheckpointError as err:
            print(err)
            sys.exit(3)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 3, proc.stderr
    assert "could not write checkpoint" in proc.stdout and "step_000000002" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000000001"]
    assert_same(store.load("latest").tensors, tensors())


def test_killed_during_save_leaves_the_previous_checkpoint(tmp_path):
    store = CheckpointStore(tmp_path)
    store.save(1, tensors(), {})
    script = textwrap.dedent(f"""
        import os, signal
        import numpy as np
        from toolkit import _checkpoint
        real = _checkpoint.json.dump
        def die(*a, **k):  # SIGKILL right before the manifest is written
            os.kill(os.getpid(), signal.SIGKILL)
        _checkpoint.json.dump = die
        _checkpoint.CheckpointStore({str(tmp_path)!r}).save(2, {{"x": np.ones(10)}}, {{}})
    """)
    assert subprocess.run([sys.executable, "-c", script]).returncode == -9
    assert [p.name for p in store.checkpoints()] == ["step_000000001"]
    assert store.load("latest").step == 1


def test_async_save_copies_arrays_and_reports_errors(tmp_path):
    store = CheckpointStore(tmp_path)
    live = {"w": np.zeros(1000)}
    store.save(1, live, {}, blocking=False)
    live["w"][:] = 5.0  # training goes on and changes the arrays
    store.wait()
    assert store.load("latest").tensors["w"].sum() == 0.0
    blocker = tmp_path / "f"
    blocker.write_text("")
    bad = CheckpointStore(blocker / "x")
    bad.save(1, live, {}, blocking=False)
    with pytest.raises(CheckpointError):
        bad.wait()


def test_object_arrays_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match="dtype object"):
        CheckpointStore(tmp_path).save(1, {"o": np.array([{}], dtype=object)}, {})
    assert not any(p.name.startswith("step_") for p in tmp_path.iterdir())
    assert os.listdir(tmp_path) == []


def save_sharded_from_ranks(tmp_path, world, step=5):
    """``world`` ranks (threads with their own store, a real barrier) save one checkpoint."""
    import threading

    barrier = threading.Barrier(world)
    full = np.arange(world * 6, dtype=np.float32).reshape(world * 2, 3)
    errors = []

    def rank(r):
        try:
            CheckpointStore(tmp_path, rank=r).save(
                step, {"params/replicated": np.ones(4)}, {"epoch": 0},
                shards={"params/sharded": (full[2 * r:2 * r + 2], 0)}, barrier=barrier.wait)
        except BaseException as err:  # surfaced below
            errors.append(err)
            barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return full


@pytest.mark.parametrize("world", [1, 3])
def test_sharded_tensors_each_rank_writes_its_piece_and_load_reassembles(tmp_path, world):
    full = save_sharded_from_ranks(tmp_path, world)
    path = tmp_path / "step_000000005"
    assert sorted(p.name for p in path.glob("shard-r*.npy")) == [
        f"shard-r{r:05d}-00000.npy" for r in range(world)]
    ckpt = CheckpointStore(tmp_path).load("latest")  # any number of ranks can read it
    assert np.array_equal(ckpt.tensors["params/sharded"], full)
    assert np.array_equal(ckpt.tensors["params/replicated"], np.ones(4))
    assert ckpt.meta["shard_ranks"] == world
    assert not list(tmp_path.glob(".tmp*"))


def test_a_missing_shard_is_detected(tmp_path):
    save_sharded_from_ranks(tmp_path, 3)
    path = tmp_path / "step_000000005"
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["tensors"] = [e for e in manifest["tensors"] if e.get("shard", {}).get("index") != 1]
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"has pieces \[0, 2\], expected one from each"):
        read_checkpoint(path)


def test_sharded_save_needs_a_barrier(tmp_path):
    with pytest.raises(CheckpointError, match="need a barrier"):
        CheckpointStore(tmp_path).save(1, {}, {}, shards={"x": (np.ones(2), 0)})


@pytest.mark.parametrize("damage", ["missing", "corrupted"])
def test_a_damaged_shard_file_is_named_and_latest_falls_back(tmp_path, damage, capsys):
    save_sharded_from_ranks(tmp_path, 3, step=5)
    save_sharded_from_ranks(tmp_path, 3, step=6)
    newest = tmp_path / "step_000000006"
    piece = newest / "shard-r00002-00000.npy"
    if damage == "missing":
        piece.unlink()
    else:
        array = np.load(piece)
        np.save(piece, array + 1)  # same shape and dtype, other values: only the CRC tells
    with pytest.raises(CheckpointError, match="shard-r00002-00000.npy") as err:
        read_checkpoint(newest)
    assert "resume from another checkpoint" in str(err.value)
    ckpt = CheckpointStore(tmp_path).load("latest")
    assert ckpt.step == 5 and "skipped damaged checkpoint" in capsys.readouterr().err
    assert piece.parent.exists()  # loading never deletes what is on disk
