"""Sharded checkpoints: every rank writes its own pieces, one manifest names them all, and a
load reassembles the full tensors (or names the piece that is missing or damaged)."""

import json

import numpy as np
import pytest

from toolkit import CheckpointError, CheckpointStore, read_checkpoint


def _edit_manifest(path, edit):
    manifest = json.loads((path / "manifest.json").read_text())
    edit(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))


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


def save_pieces_from_ranks(directory, world, pieces, step=5):
    """Each rank (a thread) saves its ``pieces[r]`` (name -> shard spec); returns what every
    rank's ``save`` returned or raised."""
    import threading

    barrier = threading.Barrier(world, timeout=10)
    out = [None] * world

    def rank(r):
        try:
            out[r] = CheckpointStore(directory, rank=r).save(
                step, {"params/replicated": np.ones(4)}, {}, shards=pieces[r],
                barrier=barrier.wait)
        except BaseException as err:
            out[r] = err
            if not isinstance(err, CheckpointError):  # raised before the ranks' last barrier
                barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_pieces_along_another_axis_and_flat_pieces_of_a_full_shape(tmp_path):
    full = np.arange(24, dtype=np.float32).reshape(2, 12)
    flat = np.arange(10.0).reshape(2, 5)
    # ZeRO-style flat pieces of 4 (the last one short here, and one empty) and column blocks
    cuts = [(0, 4), (4, 8), (8, 10), (10, 10)]
    pieces = [{"cols": (full[:, 4 * r:4 * r + 4], 1) if r < 3 else (full[:, 12:], 1),
               "flat": (flat.reshape(-1)[a:b], 0, flat.shape)} for r, (a, b) in enumerate(cuts)]
    out = save_pieces_from_ranks(tmp_path / "deep" / "dir", 4, pieces)
    assert out == [tmp_path / "deep" / "dir" / "step_000000005", None, None, None]
    ckpt = CheckpointStore(tmp_path / "deep" / "dir").load()
    assert np.array_equal(ckpt.tensors["cols"], full)
    assert ckpt.tensors["flat"].shape == (2, 5) and np.array_equal(ckpt.tensors["flat"], flat)
    # one rank: its single flat piece is the whole tensor, reshaped
    one = save_pieces_from_ranks(tmp_path / "one", 1, [{"flat": (flat.reshape(-1), 0, (2, 5))}])
    assert np.array_equal(read_checkpoint(one[0]).tensors["flat"], flat)
    # a manifest whose full shape does not match the pieces' values is incomplete
    path = out[0]
    _edit_manifest(path, lambda m: [e["shard"].update(shape=[3, 5]) for e in m["tensors"]
                                    if e["name"] == "flat"])
    with pytest.raises(CheckpointError) as err:
        read_checkpoint(path)
    assert str(err.value) == (
        f"{path}: the pieces of tensor 'flat' hold 10 values, its shape [3, 5] needs 15\n"
        "HINT: the checkpoint is incomplete; resume from another checkpoint")


def test_a_missing_piece_message(tmp_path):
    save_sharded_from_ranks(tmp_path, 3)
    path = tmp_path / "step_000000005"
    _edit_manifest(path, lambda m: m.update(tensors=[
        e for e in m["tensors"] if e.get("shard", {}).get("index") != 1]))
    with pytest.raises(CheckpointError) as err:
        read_checkpoint(path)
    assert str(err.value) == (
        f"{path}: tensor 'params/sharded' has pieces [0, 2], expected one from each of 3 ranks\n"
        "HINT: the checkpoint is incomplete; resume from another checkpoint")


def test_a_stale_shared_temporary_directory_is_replaced(tmp_path):
    stale = tmp_path / ".tmp.step_000000005.shared"
    stale.mkdir()
    (stale / "shard-r00007-00000.npy").write_text("from a save killed earlier")
    full = save_sharded_from_ranks(tmp_path, 2)
    assert np.array_equal(CheckpointStore(tmp_path).load().tensors["params/sharded"], full)
    assert not stale.exists()


def test_a_failed_sharded_write_fails_on_every_rank_and_leaves_no_temporary(tmp_path,
                                                                             monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    out = save_pieces_from_ranks(blocker / "c", 2, [{"x": (np.ones(2), 0)}] * 2)
    assert all(isinstance(err, CheckpointError) for err in out)
    # rank 0 names the directory it could not create; the others the piece they could not write
    assert str(out[0]) == (
        f"could not write the shards of checkpoint step 5 in {blocker / 'c'}: [Errno 20] "
        f"Not a directory: '{blocker / 'c'}'\nHINT: check that the directory is writable "
        "and has free space (the previous checkpoint is untouched)")
    assert str(out[1]).startswith(
        f"could not write the shards of checkpoint step 5 in {blocker / 'c'}: [Errno 20] ")
    # a disk that fills while the pieces are written
    from toolkit.checkpoint import store as _checkpoint

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_checkpoint.os, "fsync", full_disk)
    out = save_pieces_from_ranks(tmp_path / "d", 2, [{"x": (np.ones(2), 0)}] * 2)
    for err in out:
        assert isinstance(err, CheckpointError)
        assert str(err).startswith(
            f"could not write the shards of checkpoint step 5 in {tmp_path / 'd'}: [Errno 28]")
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == []
