"""The store's cleanup never turns a good save into a failure, nor hides a failed one.

On network storage (NFS) a file that some process still holds open is renamed to
``.nfsXXXX`` when deleted, and removing it fails with EBUSY until it is closed, so the
directory that holds it cannot be removed either. The same happens when another process has
already pruned the directory. These tests make the removal of ``.nfs*`` files fail the way
NFS does (``os.unlink`` raising EBUSY for them, which is what ``shutil.rmtree`` calls) and
check what the store does around it: pruning an old checkpoint, replacing a re-saved step,
and cleaning up after a write that failed.
"""

import errno
import os

import numpy as np
import pytest

from toolkit import CheckpointError, CheckpointStore


def tensors(value):
    return {"params/w": np.full((3, 2), value, np.float32)}


@pytest.fixture
def busy_nfs_files(monkeypatch):
    """Deleting a file named .nfs* fails with EBUSY, as on NFS while it is held open."""
    unlink = os.unlink

    def nfs_unlink(path, *args, **kwargs):
        if os.path.basename(os.fspath(path)).startswith(".nfs"):
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), os.fspath(path))
        return unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", nfs_unlink)


def test_the_busy_file_really_blocks_removal(tmp_path, busy_nfs_files):
    """The premise of the tests below: rmtree without ignore_errors fails on such a file."""
    import shutil
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / ".nfs0001").write_bytes(b"x")
    with pytest.raises(OSError):
        shutil.rmtree(tmp_path / "d")
    assert (tmp_path / "d" / ".nfs0001").exists()


def test_pruning_an_old_checkpoint_that_cannot_be_removed_keeps_the_new_one(
        tmp_path, busy_nfs_files):
    store = CheckpointStore(tmp_path, keep=1)
    first = store.save(1, tensors(1.0), {})
    (first / ".nfs0001").write_bytes(b"held open elsewhere")
    second = store.save(2, tensors(2.0), {})  # prunes step 1, whose removal fails
    assert (tmp_path / "latest").read_text().strip() == second.name
    assert np.array_equal(store.load("latest").tensors["params/w"], tensors(2.0)["params/w"])
    assert (first / ".nfs0001").exists()  # left for the holder to close; nothing raised
    third = store.save(3, tensors(3.0), {})  # and the next save prunes past it again
    assert store.load("latest").step == 3 and third.name == "step_000000003"


def test_resaving_a_step_whose_old_copy_cannot_be_removed_keeps_the_new_copy(
        tmp_path, busy_nfs_files):
    store = CheckpointStore(tmp_path, keep=3)
    path = store.save(5, tensors(1.0), {"epoch": 0})
    (path / ".nfs0002").write_bytes(b"held open elsewhere")
    again = store.save(5, tensors(9.0), {"epoch": 1})
    assert again == path
    ckpt = store.load("latest")
    assert ckpt.step == 5 and ckpt.meta["epoch"] == 1
    assert np.array_equal(ckpt.tensors["params/w"], tensors(9.0)["params/w"])
    assert not (path / ".nfs0002").exists()  # it went with the old copy, set aside


def _failing_write(monkeypatch, tmp_path, exception):
    """The first fsync of a checkpoint's file fails, after a busy file appeared beside it."""
    def fsync(fd):
        for tmp in tmp_path.glob(".tmp.*"):
            (tmp / ".nfs0003").write_bytes(b"held open elsewhere")
        raise exception

    monkeypatch.setattr(os, "fsync", fsync)


def test_a_failed_write_whose_cleanup_fails_is_still_reported_clearly(
        tmp_path, busy_nfs_files, monkeypatch):
    store = CheckpointStore(tmp_path, keep=3)
    good = store.save(1, tensors(1.0), {})
    _failing_write(monkeypatch, tmp_path, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    with pytest.raises(CheckpointError) as err:
        store.save(2, tensors(2.0), {})
    assert str(err.value).startswith(
        f"could not write checkpoint {tmp_path / 'step_000000002'}: No space left on device")
    monkeypatch.undo()
    assert store.load("latest").step == 1 and store.checkpoints() == [good]


def test_an_interrupted_write_whose_cleanup_fails_still_raises_the_interrupt(
        tmp_path, busy_nfs_files, monkeypatch):
    store = CheckpointStore(tmp_path, keep=3)
    store.save(1, tensors(1.0), {})
    _failing_write(monkeypatch, tmp_path, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        store.save(2, tensors(2.0), {})
    monkeypatch.undo()
    assert store.load("latest").step == 1
