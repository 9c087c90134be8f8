"""print0/save0 act on global rank 0 only; save0 and atomic_open never leave half a file."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from toolkit import LaunchEnv, atomic_open, print0, save0

RANK0 = LaunchEnv(world_size=2, rank=0, local_size=2)
RANK1 = LaunchEnv(world_size=2, rank=1, local_rank=1, local_size=2)


def test_print0_prints_on_rank_0_only(capsys):
    print0("hello", env=RANK0)
    print0("hidden", env=RANK1)
    assert capsys.readouterr().out == "hello\n"


def test_save0_writes_on_rank_0_only(tmp_path):
    assert save0(tmp_path / "a.txt", "rank0", env=RANK0) is True
    assert save0(tmp_path / "b.txt", "rank1", env=RANK1) is False
    assert (tmp_path / "a.txt").read_text() == "rank0"
    assert not (tmp_path / "b.txt").exists()


def test_save0_takes_a_writer_function_and_creates_folders(tmp_path):
    target = tmp_path / "deep" / "w.npy"
    save0(target, lambda f: np.save(f, np.arange(5)), env=RANK0)
    assert np.load(target).tolist() == [0, 1, 2, 3, 4]


def test_a_failing_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "model.bin"
    save0(target, b"old", env=RANK0)

    def boom(f):
        f.write(b"half of the new")
        raise RuntimeError("disk gone")

    with pytest.raises(RuntimeError):
        save0(target, boom, env=RANK0)
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["model.bin"]


def test_a_killed_writer_leaves_the_old_file_complete(tmp_path):
    """SIGKILL in the middle of a write: the final name still holds the old, whole content."""
    target = tmp_path / "state.bin"
    target.write_bytes(b"A" * 1000)
    script = textwrap.dedent(f"""
        import os, signal
        from toolkit import atomic_open
        with atomic_open({str(target)!r}) as f:
            f.write(b"B" * 500)
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script])
    assert proc.returncode == -9
    assert target.read_bytes() == b"A" * 1000


def test_atomic_open_text_mode(tmp_path):
    with atomic_open(tmp_path / "t.txt", "w") as f:
        f.write("ok")
    assert (tmp_path / "t.txt").read_text() == "ok"
