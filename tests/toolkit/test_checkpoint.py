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
        from toolkit.checkpoint import store as _checkpoint
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


def _edit_manifest(path, edit):
    manifest = json.loads((path / "manifest.json").read_text())
    edit(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_errors_name_the_file_and_say_what_to_do(tmp_path):
    store = CheckpointStore(tmp_path / "s")
    path = store.save(1, tensors(), {})
    manifest = path / "manifest.json"
    w = path / "00000.npy"

    def message(call):
        with pytest.raises(CheckpointError) as err:
            call()
        return str(err.value)

    assert message(lambda: CheckpointStore(tmp_path, keep=0)) == (
        "keep=0 would delete every checkpoint\nHINT: keep at least 1 (the default is 3)")
    assert message(lambda: store.save(2, {"o": np.array([{}], dtype=object)}, {})) == (
        "tensor 'o' has dtype object, which .npy can only store with pickle\n"
        "HINT: store numeric arrays only")
    assert message(lambda: store.save(2, {}, {}, shards={"x": (np.ones(2), 0)})) == (
        "sharded saves need a barrier and blocking=True\nHINT: pass barrier=adapter.barrier")
    assert message(lambda: CheckpointStore(tmp_path / "none").load()) == (
        f"no checkpoint in {tmp_path / 'none'}\n"
        "HINT: train with a checkpoint directory first, or drop --resume")
    assert message(lambda: read_checkpoint(tmp_path)) == (
        f"{tmp_path / 'manifest.json'} does not exist\n"
        "HINT: pass a step_* directory written by this toolkit")
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert message(lambda: CheckpointStore(blocker / "c").save(1, tensors(), {})) == (
        f"could not write checkpoint {blocker / 'c' / 'step_000000001'}: Not a directory\n"
        "HINT: check that the directory is writable and has free space (the previous "
        "checkpoint is untouched)")
    # damage, one kind at a time (each restored after)
    good_w, good_manifest = w.read_bytes(), manifest.read_text()
    _edit_manifest(path, lambda m: m["tensors"][0].update(shape=[3, 4]))
    assert message(lambda: read_checkpoint(path)) == (
        f"{w} (tensor 'params/w') holds <f4[4, 3], the manifest says <f4[3, 4]\n"
        "HINT: resume from another checkpoint")
    manifest.write_text(good_manifest)
    _edit_manifest(path, lambda m: m["tensors"][0].update(dtype="<f8"))
    assert message(lambda: read_checkpoint(path)) == (
        f"{w} (tensor 'params/w') holds <f4[4, 3], the manifest says <f8[4, 3]\n"
        "HINT: resume from another checkpoint")
    manifest.write_text(good_manifest)
    raw = bytearray(good_w)
    raw[-1] ^= 0xFF
    w.write_bytes(bytes(raw))
    assert message(lambda: read_checkpoint(path)) == (
        f"{w} (tensor 'params/w') fails its checksum\n"
        "HINT: the file is corrupted; resume from another checkpoint")
    w.write_bytes(good_w[:-7])
    text = message(lambda: read_checkpoint(path))
    assert text.startswith(f"{w} (tensor 'params/w') is unreadable or truncated (")
    assert text.endswith(")\nHINT: resume from another checkpoint")
    w.write_bytes(good_w)
    manifest.write_text('{"format": "hpc-tool')
    text = message(lambda: read_checkpoint(path))
    assert text.startswith(f"{manifest} is unreadable or truncated (")
    assert text.endswith(")\nHINT: resume from another checkpoint")
    manifest.write_text(good_manifest)
    _edit_manifest(path, lambda m: m.update(format="other"))
    assert message(lambda: read_checkpoint(path)) == (
        f"{manifest} is not a hpc-toolkit-checkpoint manifest\n"
        "HINT: pass a step_* directory written by this toolkit")
    assert message(lambda: store.load()) == (
        f"no intact checkpoint in {tmp_path / 's'}: {manifest} is not a hpc-toolkit-checkpoint "
        "manifest\nHINT: resume from an earlier copy, or start without --resume")
    manifest.write_text(good_manifest)
    _edit_manifest(path, lambda m: m.update(format_version=2))
    assert message(lambda: read_checkpoint(path)) == (
        f"{manifest} has format version 2; this toolkit reads version 1\n"
        "HINT: load it with the toolkit version that wrote it")


def test_a_pickled_array_is_never_loaded(tmp_path):
    """Loading a checkpoint never runs code: an object array (pickled) in place of a tensor
    is an unreadable file, not an unpickled one."""
    path = CheckpointStore(tmp_path).save(1, tensors(), {})
    np.save(path / "00000.npy", np.array([{"x": 1}], dtype=object), allow_pickle=True)
    _edit_manifest(path, lambda m: m["tensors"][0].update(shape=[1], dtype="|O"))
    with pytest.raises(CheckpointError, match="is unreadable or truncated"):
        read_checkpoint(path)


def test_loaded_checkpoint_has_its_path_and_metadata_without_the_tensor_list(tmp_path):
    store = CheckpointStore(tmp_path)
    path = store.save(10, tensors(), {"epoch": 1, "sampler": {"step": 3}})
    for ckpt in (store.load(), store.load(path), store.load(str(path))):
        assert ckpt.path == path
        assert ckpt.meta == {"format": "hpc-toolkit-checkpoint", "format_version": 1,
                             "step": 10, "epoch": 1, "sampler": {"step": 3}}
        assert_same(ckpt.tensors, tensors())


def test_a_clean_load_says_nothing(tmp_path, capsys):
    store = CheckpointStore(tmp_path)
    store.save(1, tensors(), {})
    store.load()
    assert capsys.readouterr().err == ""


def test_the_fallback_message_lists_every_damaged_checkpoint(tmp_path, capsys):
    store = CheckpointStore(tmp_path)
    for step in (1, 2, 3):
        store.save(step, tensors(step), {})
    for step in (2, 3):
        (tmp_path / f"step_00000000{step}" / "manifest.json").write_text("{}")
    assert store.load().step == 1
    names = [tmp_path / f"step_00000000{step}" / "manifest.json" for step in (3, 2)]
    assert capsys.readouterr().err == (
        f"[checkpoint] skipped damaged checkpoint(s): {names[0]} is not a hpc-toolkit-checkpoint "
        f"manifest; {names[1]} is not a hpc-toolkit-checkpoint manifest; resuming from "
        f"{tmp_path / 'step_000000001'}\n")
    (tmp_path / "step_000000001" / "manifest.json").write_text("{}")
    with pytest.raises(CheckpointError) as err:
        store.load()
    names.append(tmp_path / "step_000000001" / "manifest.json")
    assert str(err.value) == (
        f"no intact checkpoint in {tmp_path}: "
        + "; ".join(f"{n} is not a hpc-toolkit-checkpoint manifest" for n in names)
        + "\nHINT: resume from an earlier copy, or start without --resume")


def test_default_keep_is_3_and_keep_1_keeps_the_newest(tmp_path):
    default, one = CheckpointStore(tmp_path / "d"), CheckpointStore(tmp_path / "o", keep=1)
    for step in (1, 2, 3, 4, 5):
        default.save(step, tensors(step), {})
        one.save(step, tensors(step), {})
    assert [p.name for p in default.checkpoints()] == [
        "step_000000003", "step_000000004", "step_000000005"]
    assert [p.name for p in one.checkpoints()] == ["step_000000005"]


def test_resaving_a_step_replaces_it_and_latest_follows_the_last_save(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    store.save(5, tensors(5), {})
    store.save(6, tensors(6), {})
    store.save(5, tensors(50), {})  # e.g. a run restarted from step 5 saves it again
    assert_same(read_checkpoint(tmp_path / "step_000000005").tensors, tensors(50))
    store.save(3, tensors(3), {})  # older than both kept ones: the one just written stays
    assert (tmp_path / "step_000000003").is_dir()
    ckpt = store.load()  # latest names the last save, not the highest step
    assert ckpt.step == 3
    assert_same(ckpt.tensors, tensors(3))
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_latest_falls_back_to_the_newest_step_without_a_pointer(tmp_path):
    store = CheckpointStore(tmp_path, keep=5)
    for step in (1, 2, 3):
        store.save(step, tensors(step), {})
    (tmp_path / "latest").unlink()
    assert store.load().step == 3
    (tmp_path / "latest").write_text("step_000000099\n")  # names a checkpoint that is gone
    assert store.load().step == 3


def test_only_step_directories_are_checkpoints_in_step_order(tmp_path):
    store = CheckpointStore(tmp_path, keep=5)
    store.save(999_999_999, tensors(1), {})
    store.save(1_000_000_000, tensors(2), {})  # one more digit than the name's padding
    (tmp_path / "step_000000007").write_text("a file, not a checkpoint")
    (tmp_path / "notes12345").mkdir()
    (tmp_path / "step_old").mkdir()
    assert [p.name for p in store.checkpoints()] == ["step_999999999", "step_1000000000"]
    assert store.load().step == 1_000_000_000


def test_a_nested_directory_is_created_and_a_stale_temporary_one_replaced(tmp_path):
    nested = tmp_path / "a" / "b"
    stale = nested / f".tmp.step_000000001.{os.getpid()}"  # left by a save killed earlier
    stale.mkdir(parents=True)
    (stale / "junk.npy").write_text("x")
    CheckpointStore(nested).save(1, tensors(), {})
    assert sorted(p.name for p in (nested / "step_000000001").iterdir()) == [
        "00000.npy", "00001.npy", "00002.npy", "manifest.json"]
    assert not stale.exists()
    CheckpointStore(tmp_path / "new" / "deeper").save(1, tensors(), {})
    assert CheckpointStore(tmp_path / "new" / "deeper").load().step == 1


def test_async_save_can_be_waited_for_twice(tmp_path):
    store = CheckpointStore(tmp_path)
    store.save(1, tensors(), {}, blocking=False)
    store.wait()
    store.wait()
    assert store.load().step == 1


def test_a_background_save_finishes_when_the_program_ends(tmp_path):
    script = textwrap.dedent(f"""
        import time
        import numpy as np
        from toolkit.checkpoint import store as _checkpoint
        write = _checkpoint._write_arrays
        def slow_write(*args):  # a slow disk: the program is done long before the write
            time.sleep(0.5)
            return write(*args)
        _checkpoint._write_arrays = slow_write
        _checkpoint.CheckpointStore({str(tmp_path)!r}).save(1, {{"w": np.ones(1000)}}, {{}},
                                                            blocking=False)
    """)  # the main thread returns at once; the writer thread must still complete
    assert subprocess.run([sys.executable, "-c", script]).returncode == 0
    assert CheckpointStore(tmp_path).load().tensors["w"].sum() == 1000


def _gated_writer(monkeypatch):
    """Makes background saves wait for the returned event before writing anything."""
    import threading

    from toolkit.checkpoint import store as _checkpoint

    go, write = threading.Event(), _checkpoint._write_arrays

    def gated(*args):
        go.wait(10)
        return write(*args)

    monkeypatch.setattr(_checkpoint, "_write_arrays", gated)
    return go


def test_a_background_save_writes_the_values_of_the_call(tmp_path, monkeypatch):
    go = _gated_writer(monkeypatch)
    live = {"w": np.zeros(1000)}
    store = CheckpointStore(tmp_path)
    store.save(1, live, {}, blocking=False)
    live["w"][:] = 5.0  # training changes the arrays before the writer runs
    go.set()
    store.wait()
    assert store.load().tensors["w"].sum() == 0.0


def test_the_interpreter_waits_for_a_background_save(tmp_path, monkeypatch):
    """Python exits only after its non-daemon threads end: the writer must be one."""
    import threading

    go = _gated_writer(monkeypatch)
    before = set(threading.enumerate())
    store = CheckpointStore(tmp_path)
    store.save(1, tensors(), {}, blocking=False)
    writers = [t for t in threading.enumerate() if t not in before]
    go.set()
    store.wait()
    assert len(writers) == 1 and not writers[0].daemon
