"""A resume compares the run's settings with the checkpoint's: trajectory changes stop it
(unless allowed, then they are said and recorded); placement changes are said."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import adapters
import toolkit
from toolkit.checkpoint.settings import classify, differences, saved_settings
from toolkit.datasets import load_digits


@pytest.fixture(scope="module")
def digits():
    return load_digits()


def schedule(total):
    return toolkit.SGD(lr=toolkit.WarmupCosine(0.1, 2, total), momentum=0.9)


def trainer(tmp_path, optimizer, backend="horovod-torch", **kw):
    options = dict(global_batch_size=64, max_steps=6, progress=False, env=toolkit.LaunchEnv(),
                   checkpoint_dir=tmp_path / "ckpt", checkpoint_every=3,
                   metrics_log=tmp_path / "log.jsonl")
    options.update(kw)
    return toolkit.Trainer(adapters.get(backend), toolkit.MLP((64, 16, 10)), optimizer,
                           **options)


def test_differences_name_nested_settings():
    old = {"optimizer": {"type": "SGD", "lr": {"peak": 0.1, "total_steps": 3000}}, "seed": 0}
    new = {"optimizer": {"type": "SGD", "lr": {"peak": 0.1, "total_steps": 800}}, "seed": 0,
           "lr_scaling": "none"}  # not recorded in old: not compared
    assert differences(old, new) == [("optimizer.lr.total_steps", 3000, 800)]


def test_an_older_checkpoint_without_a_settings_record_is_read_from_its_other_fields():
    meta = {"sampler": {"global_batch_size": 64, "shuffle": True, "drop_last": True},
            "rng": {"seed": 3}, "model": None, "optimizer": None, "backend": "jax-pjit",
            "layout": "data_parallel", "world_size": 2}
    saved = saved_settings(meta)
    assert saved["seed"] == 3 and saved["global_batch_size"] == 64 and "lr_scaling" not in saved
    trajectory, placement = classify(saved, {**saved, "world_size": 4})
    assert trajectory == [] and placement == [("world_size", 2, 4)]


def test_a_changed_schedule_stops_the_resume_with_the_list_of_changes(digits, tmp_path):
    (x, y), _ = digits
    trainer(tmp_path, schedule(30)).fit(x, y)
    with pytest.raises(toolkit.ToolkitError) as err:
        trainer(tmp_path, schedule(8), max_steps=8, resume="latest",
                global_batch_size=32).fit(x, y)
    text = str(err.value)
    assert "would change the run" in text and "optimizer.lr.total_steps 30 -> 8" in text
    assert "global_batch_size 64 -> 32" in text and "--allow-changes" in text
    # nothing was lost: the checkpoint is still the newest
    assert toolkit.CheckpointStore(tmp_path / "ckpt").load("latest").step == 6


def test_allowed_changes_are_said_and_recorded(digits, tmp_path, capsys):
    (x, y), _ = digits
    trainer(tmp_path, schedule(30)).fit(x, y)
    resumed = trainer(tmp_path, schedule(12), max_steps=12, resume="latest",
                      allow_changes=True, global_batch_size=32)
    resumed.fit(x, y)
    out = capsys.readouterr().out
    assert "resumed with changed settings (allowed): " in out
    assert "optimizer.lr.total_steps 30 -> 12" in out
    # 6 steps of 64 samples are 12 steps of 32: the position moves by samples
    assert resumed.sampler.state_dict()["step"] == 12 + 6
    latest = toolkit.CheckpointStore(tmp_path / "ckpt").load("latest")
    assert latest.step == 12
    changes = [["optimizer.lr.total_steps", 30, 12], ["global_batch_size", 64, 32]]
    assert latest.meta["changes"] == [{"step": 6, "changes": changes}]
    assert latest.meta["settings"]["optimizer"]["lr"]["total_steps"] == 12
    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["changes"] for r in log if r["event"] == "changes"] == [changes]


def test_another_backend_is_allowed_and_said(digits, tmp_path, capsys):
    (x, y), _ = digits
    trainer(tmp_path, schedule(30)).fit(x, y)
    trainer(tmp_path, schedule(30), backend="jax-pjit", max_steps=9, resume="latest").fit(x, y)
    out = capsys.readouterr().out
    assert "resumed on another placement: backend 'horovod-torch' -> 'jax-pjit'" in out
    assert "changed settings" not in out


FIXTURE = Path(__file__).parents[1] / "fixtures" / "checkpoint-before-settings"


def test_a_checkpoint_written_before_settings_were_recorded_resumes_as_a_new_one_does(
        digits, tmp_path, capsys):
    """tests/fixtures/checkpoint-before-settings: 4 steps of MLP 64-16-10, SGD with a
    warm-up + cosine schedule over 8 steps, batch 64, seed 0, written by horovod-torch before
    checkpoints recorded a settings block. It resumes with the same settings without a word
    about changes, and ends bit for bit where the same stored state ends when its checkpoint
    carries today's settings block (both resumes compute steps 5-8 on this machine)."""
    (x, y), _ = digits
    shutil.copytree(FIXTURE, tmp_path / "ckpt")
    assert "settings" not in toolkit.read_checkpoint(tmp_path / "ckpt" / "step_000000004").meta
    resumed = trainer(tmp_path, schedule(8), max_steps=8, resume="latest")
    resumed.fit(x, y)
    out = capsys.readouterr().out
    assert "resumed from" in out and "changed settings" not in out
    assert "another placement" not in out
    # The same stored arrays, with the settings block a checkpoint written today carries.
    today = toolkit.read_checkpoint(tmp_path / "ckpt" / "step_000000008").meta["settings"]
    shutil.copytree(FIXTURE, tmp_path / "same" / "ckpt")
    manifest = tmp_path / "same" / "ckpt" / "step_000000004" / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "settings": today}))
    same = trainer(tmp_path / "same", schedule(8), max_steps=8, resume="latest")
    same.fit(x, y)
    a, b = resumed.adapter.state_dict(), same.adapter.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    # An uninterrupted run computes steps 1-4 again, with this CPU's float32 kernels, which may
    # round differently from those of the CPU that wrote the fixture (1 float32 ulp seen): the
    # end state agrees to float32 rounding, not bit for bit.
    straight = trainer(tmp_path / "straight", schedule(8), max_steps=8)
    straight.fit(x, y)
    c = straight.adapter.state_dict()
    for name in a:
        np.testing.assert_allclose(a[name], c[name], rtol=1e-5, atol=1e-6, err_msg=name)
    with pytest.raises(toolkit.ToolkitError, match="optimizer.lr.total_steps 8 -> 9"):
        shutil.rmtree(tmp_path / "ckpt")
        shutil.copytree(FIXTURE, tmp_path / "ckpt")
        trainer(tmp_path, schedule(9), max_steps=9, resume="latest").fit(x, y)


def test_the_loss_scalers_settings_are_run_settings(digits, tmp_path):
    """init_scale and growth_interval reach the scaler (the scale doubles after each
    growth_interval clean steps from init_scale) and are recorded: a resume with another
    value stops unless allowed."""
    (x, y), _ = digits

    def scaled(**kw):
        return toolkit.Trainer(adapters.get("horovod-torch", precision="fp16-mixed"),
                               toolkit.MLP((64, 16, 10)), toolkit.SGD(lr=0.05),
                               global_batch_size=64, progress=False,
                               env=toolkit.LaunchEnv(), checkpoint_dir=tmp_path / "ckpt",
                               checkpoint_every=4, **{"max_steps": 7, **kw})

    history = scaled(init_scale=256, growth_interval=3).fit(x, y)
    assert history.loss_scales == [256.0] * 3 + [512.0] * 3 + [1024.0]
    latest = toolkit.CheckpointStore(tmp_path / "ckpt").load("latest")
    assert latest.meta["settings"]["loss_scaling"] == {"init_scale": 256.0, "growth_interval": 3}
    assert float(latest.tensors["scaler/scale"]) == 1024.0  # (the scale of step 8)
    with pytest.raises(toolkit.ToolkitError, match=r"loss_scaling.growth_interval 3 -> 5"):
        scaled(init_scale=256, growth_interval=5, max_steps=9, resume="latest").fit(x, y)
    resumed = scaled(init_scale=256, growth_interval=5, max_steps=9, resume="latest",
                     allow_changes=True).fit(x, y)
    assert resumed.loss_scales == [1024.0, 1024.0]  # the saved scale goes on
    # a run that does not scale its loss records nothing of a scaler
    plain = trainer(tmp_path / "plain", toolkit.SGD(lr=0.05)).fit(x, y)
    assert plain.loss_scales == []
    meta = toolkit.CheckpointStore(tmp_path / "plain" / "ckpt").load("latest").meta
    assert "loss_scaling" not in meta["settings"]
