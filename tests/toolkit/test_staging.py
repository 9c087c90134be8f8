"""stage: a verified node-local copy made once, re-used while good, replaced when not.

Local ranks are LaunchEnv values here (a waiting rank runs in a thread or a second process
beside local rank 0); tests/test_staging_one_node.py runs the same under mpirun.
"""

import hashlib
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from toolkit import LaunchEnv, TokenWindows, ToolkitError
from toolkit.data.staging import STAGED_FOLDER, stage
from toolkit.datasets import load_text, stage_text

RANK0 = LaunchEnv(world_size=2, rank=0, local_size=2)
RANK1 = LaunchEnv(world_size=2, rank=1, local_rank=1, local_size=2)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "shared" / "corpus.npy"
    path.parent.mkdir()
    path.write_bytes(os.urandom((8 << 20) + 12345))  # more than one chunk, not a whole number
    return path


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def marker_of(copy: Path) -> dict:
    return json.loads(copy.with_name(copy.name + ".staged").read_text())


def test_copies_once_and_records_the_hash(source, tmp_path, capsys):
    local = tmp_path / "local"
    copy = stage(source, local, env=RANK0)
    assert copy.parent.parent == local / STAGED_FOLDER and copy.name == "corpus.npy"
    assert copy.read_bytes() == source.read_bytes()
    marker = marker_of(copy)
    assert marker["sha256"] == sha(source)
    assert (marker["source"], marker["source_bytes"]) == (str(source), source.stat().st_size)
    assert marker["file"]["ino"] == copy.stat().st_ino
    assert sorted(p.name for p in copy.parent.iterdir()) == ["corpus.npy", "corpus.npy.staged"]
    out = capsys.readouterr().out
    assert f" copied {source} to {copy} (8.4 MB in " in out and "verified)" in out
    # the waiting rank gets the same path, at once
    assert stage(source, local, env=RANK1, timeout=1) == copy


def test_a_good_copy_is_reused(source, tmp_path, capsys):
    copy = stage(source, tmp_path / "local", env=RANK0)
    before = copy.stat()
    assert stage(source, tmp_path / "local", env=RANK0, sha256=sha(source).upper()) == copy
    assert (copy.stat().st_ino, copy.stat().st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert " re-uses " in capsys.readouterr().out.splitlines()[-1]


@pytest.mark.parametrize("damage", ["source changed", "copy truncated", "copy bytes flipped",
                                    "marker missing", "marker garbled"])
def test_a_stale_or_damaged_copy_is_replaced(source, tmp_path, capsys, damage):
    local = tmp_path / "local"
    copy = stage(source, local, env=RANK0)
    marker = copy.with_name(copy.name + ".staged")
    if damage == "source changed":
        source.write_bytes(b"a new version")
    elif damage == "copy truncated":
        os.truncate(copy, 1000)
    elif damage == "copy bytes flipped":  # same size, same inode, same modification time
        info = copy.stat()
        with open(copy, "r+b") as f:
            f.seek(5000)
            f.write(bytes(b ^ 0xFF for b in f.read(3)))
        os.utime(copy, ns=(info.st_atime_ns, info.st_mtime_ns))
    elif damage == "marker missing":
        marker.unlink()
    else:
        marker.write_text("{")
    capsys.readouterr()
    got = {}
    waiter = threading.Thread(target=lambda: got.update(path=stage(source, local, env=RANK1)))
    waiter.start()
    if damage != "copy bytes flipped":  # what only local rank 0's hash can see
        time.sleep(0.2)
        assert waiter.is_alive()  # the others wait for local rank 0 to replace the copy
    assert stage(source, local, env=RANK0) == copy
    assert " copied " in capsys.readouterr().out
    waiter.join(timeout=10)
    assert got["path"] == copy
    assert copy.read_bytes() == source.read_bytes() and marker_of(copy)["sha256"] == sha(source)


def test_the_others_wait_for_local_rank_0(source, tmp_path):
    local, got = tmp_path / "local", {}
    waiter = threading.Thread(target=lambda: got.update(path=stage(source, local, env=RANK1)))
    waiter.start()
    time.sleep(0.3)
    assert waiter.is_alive()  # nothing staged yet: still waiting
    copy = stage(source, local, env=RANK0)
    waiter.join(timeout=10)
    assert got["path"] == copy


def test_a_waiting_rank_gives_up_naming_the_path(source, tmp_path):
    with pytest.raises(ToolkitError, match=r"local rank 0 showed no progress staging "
                       rf"{source} to {tmp_path}/local/{STAGED_FOLDER}/\w+/corpus.npy for "
                       r"0.2 s\nHINT: look for local rank 0's error"):
        stage(source, tmp_path / "local", env=RANK1, timeout=0.2)


def test_a_growing_copy_keeps_the_others_waiting(source, tmp_path):
    """The timeout counts from local rank 0's last sign of life: a temporary copy growing."""
    folder = tmp_path / "local"
    copy = stage(source, folder, env=RANK0)  # where it goes; then start again
    marker = copy.with_name(copy.name + ".staged")
    marker.unlink()
    tmp = copy.with_name(f".corpus.npy.otherhost-{os.getpid()}-0123abcd.tmp")
    got = {}
    waiter = threading.Thread(target=lambda: got.update(
        path=stage(source, folder, env=RANK1, timeout=0.4)))
    waiter.start()
    for _ in range(6):  # 1.2 s in all: three timeouts
        with open(tmp, "ab") as f:
            f.write(b"x")
        time.sleep(0.2)
    tmp.unlink()
    assert waiter.is_alive()
    stage(source, folder, env=RANK0)
    waiter.join(timeout=10)
    assert got["path"] == copy


def test_an_abandoned_temporary_copy_is_removed(source, tmp_path):
    copy = stage(source, tmp_path / "local", env=RANK0)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    host = socket.gethostname()
    abandoned = copy.with_name(f".corpus.npy.{host}-{dead}-0123abcd.tmp")
    alive = copy.with_name(f".corpus.npy.{host}-{os.getpid()}-0123abcd.tmp")
    elsewhere = copy.with_name(f".corpus.npy.otherhost-{dead}-0123abcd.tmp")
    for path in (abandoned, alive, elsewhere):
        path.write_bytes(b"partial")
    stage(source, tmp_path / "local", env=RANK0)
    assert (abandoned.exists(), alive.exists(), elsewhere.exists()) == (False, True, True)


def test_a_source_without_the_expected_hash_is_refused(source, tmp_path):
    wrong = "0" * 64
    with pytest.raises(ToolkitError, match=rf"{source} has sha256 {sha(source)}, not the "
                                           rf"expected {wrong}\nHINT: "):
        stage(source, tmp_path / "local", env=RANK0, sha256=wrong)
    folder = next((tmp_path / "local" / STAGED_FOLDER).iterdir())
    assert list(folder.iterdir()) == []  # the refused copy is gone


def test_missing_source_and_unusable_local_dir(source, tmp_path, monkeypatch):
    missing = tmp_path / "shared" / "nope.npy"
    for env in (RANK0, RANK1):  # every rank says it at once: none waits for the other
        with pytest.raises(ToolkitError, match=rf"cannot stage {missing}: No such file.*\n"
                                               "HINT: pass the path of the data set"):
            stage(missing, tmp_path, env=env)
        with pytest.raises(ToolkitError, match=rf"cannot stage {source.parent}: it is a "
                                               "directory"):
            stage(source.parent, tmp_path, env=env)
        with pytest.raises(ToolkitError, match=rf"cannot stage into {source}/sub \(local_dir="
                                               rf"{source}/sub\): {source} is not a directory"
                                               r"\nHINT: name a writable directory"):
            stage(source, source / "sub", env=env, timeout=0.1)
    monkeypatch.delenv("SLURM_TMPDIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(source))
    with pytest.raises(ToolkitError, match=rf"\(\$TMPDIR={source}\): {source} is not a dir"):
        stage(source, env=RANK0)
    monkeypatch.setenv("TMPDIR", "")
    with pytest.raises(ToolkitError, match=r"no node-local directory to stage to: neither "
                       r"SLURM_TMPDIR nor TMPDIR is set\nHINT: pass stage\(path, local_dir="):
        stage(source, env=RANK0)


def test_the_local_dir_comes_from_slurm_tmpdir_then_tmpdir(source, tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_TMPDIR", str(tmp_path / "slurm"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    assert stage(source, env=RANK0).is_relative_to(tmp_path / "slurm")
    monkeypatch.delenv("SLURM_TMPDIR")
    assert stage(source, env=RANK0).is_relative_to(tmp_path / "tmp")
    assert stage(source, tmp_path / "given", env=RANK0).is_relative_to(tmp_path / "given")


def test_nodes_sharing_one_local_dir_do_not_corrupt_each_other(source, tmp_path):
    """Two local ranks 0 (two nodes whose $TMPDIR is, by mistake, one shared folder) and a
    waiting rank, in three processes at once: both copies are verified and renamed
    atomically, so the file is always whole; the marker ends describing it."""
    code = textwrap.dedent(f"""
        import sys
        from toolkit import LaunchEnv
        from toolkit.data.staging import stage
        env = LaunchEnv(world_size=2, rank=int(sys.argv[1]), local_rank=int(sys.argv[1]),
                        local_size=2)
        print("path", stage({str(source)!r}, {str(tmp_path / "local")!r}, env=env, timeout=30))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code, rank], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
             for rank in ("0", "0", "1")]
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    paths = {line.split(" ", 1)[1] for out, _ in outs for line in out.splitlines()
             if line.startswith("path ")}
    (copy,) = map(Path, paths)
    assert copy.read_bytes() == source.read_bytes()
    assert marker_of(copy)["file"]["ino"] == copy.stat().st_ino
    assert sorted(p.name for p in copy.parent.iterdir()) == ["corpus.npy", "corpus.npy.staged"]


def test_stage_text_maps_the_same_corpus_from_the_copy(tmp_path):
    corpus = load_text()
    staged = stage_text(corpus, tmp_path, env=RANK0)
    assert staged.path.is_relative_to(tmp_path) and staged.path.name == corpus.path.name
    assert (staged.sha256, staged.files, len(staged.train), len(staged.val)) == (
        corpus.sha256, corpus.files, len(corpus.train), len(corpus.val))
    assert bytes(staged.val[-100:]) == bytes(corpus.val[-100:])
    # a checkpoint's data fingerprint is the same: resuming across staged and unstaged runs
    assert TokenWindows(staged.val, 64).fingerprint == TokenWindows(corpus.val, 64).fingerprint
