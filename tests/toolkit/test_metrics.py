"""What rank 0 reports of a run: the metrics log's step, interval and eval records, the MFU's
FLOPs and peaks, TensorBoard's event files and the progress bar, with numpy stand-in
backends."""

import json
import os
import sys
import time

import numpy as np
import pytest
from test_trainer import LrRecorder

import toolkit
from toolkit.errors import ToolkitError
from toolkit.models.flops import (
    device_peak,
    gpu_models,
    peak_flops,
    training_flops_per_sample,
)
from toolkit.precision import LossScaler
from toolkit.trainer.metrics import IntervalMeter, native_lr

GPT = toolkit.GPT(vocab=256, context=16, width=32, layers=2, heads=2)


class SteadyBackend(LrRecorder):
    """A numpy stand-in for one rank of any world: each step takes ``seconds`` and returns a
    loss, a gradient norm and (with ``scale``) a loss scale."""

    name = "steady"

    def __init__(self, seconds=0.003, scale=None):
        super().__init__()
        self.seconds, self.scale = seconds, scale

    def build(self, model, optimizer, loss, *, seed=0, clip_grad_norm=None, **options):
        super().build(model, optimizer, loss, seed=seed, **options)

    def train_step(self, x, y, lr):
        time.sleep(self.seconds)
        super().train_step(x, y, lr)
        return toolkit.StepResult(1.0 / len(self.lrs), grad_norm=float(len(self.lrs)),
                                  loss_scale=self.scale)

    def evaluate(self, x, y):
        return {"loss_sum": 0.5 * len(x), "correct": 0.0, "count": float(len(x))}


def tokens():
    return toolkit.TokenWindows(np.arange(64 * 16 + 1, dtype=np.uint8) % 251, context=16)


def records_of(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def gpt_run(tmp_path, world_size=2, **kw):
    env = toolkit.LaunchEnv(world_size=world_size, rank=0, local_size=world_size)
    options = dict(global_batch_size=8, max_steps=23, progress=False, env=env, log_every=10,
                   metrics_log=tmp_path / "m.jsonl", tensorboard_dir=tmp_path / "tb",
                   clip_grad_norm=1.0)
    options.update(kw)
    trainer = toolkit.Trainer(SteadyBackend(scale=1024.0), GPT,
                              toolkit.SGD(lr=toolkit.WarmupCosine(0.1, 5, 23)), **options)
    data = tokens()
    trainer.fit(data, validation=data)
    trainer.evaluate(data)
    return trainer, records_of(tmp_path / "m.jsonl")


def test_step_interval_and_eval_records_follow_the_schema(tmp_path):
    trainer, records = gpt_run(tmp_path, peak_flops=1e9, epochs=1, max_steps=None)
    steps = [r for r in records if r["event"] == "step"]
    intervals = [r for r in records if r["event"] == "interval"]
    assert [r["step"] for r in steps] == list(range(1, 9))  # 64 windows / 8: one epoch
    assert len({r["time"] for r in steps}) == len(steps)  # each step its own time
    assert [r["time"] for r in steps] == sorted(r["time"] for r in steps)
    schedule = toolkit.WarmupCosine(0.1, 5, 23)
    assert [r["lr"] for r in steps] == pytest.approx([schedule(s) for s in range(8)])
    assert [r["grad_norm"] for r in steps] == list(range(1, 9))
    assert all(r["loss_scale"] == 1024.0 for r in steps)
    # one interval at the epoch's end (the stop check every 10 steps comes later)
    (interval,) = intervals
    assert interval["steps"] == 8 and interval["step"] == 8 and interval["world_size"] == 2
    assert interval["tokens_per_s"] == pytest.approx(interval["samples_per_s"] * 16, rel=1e-5)
    seconds = 8 * 8 / interval["samples_per_s"]  # the interval's wall time
    assert seconds >= interval["time"] - steps[0]["time"] - 2e-3  # from its first step's start
    assert seconds <= interval["time"] - next(r["time"] for r in records
                                              if r["event"] == "start") + 2e-3
    assert 0.003 <= interval["step_time_s"] <= seconds
    assert 0 <= interval["input_wait_s"] < interval["step_time_s"]
    assert interval["grad_norm"] == pytest.approx(4.5)  # the interval's mean
    assert interval["loss_scale"] == 1024.0 and interval["lr"] == steps[-1]["lr"]
    per_sample = training_flops_per_sample(GPT)
    assert interval["mfu"] == pytest.approx(
        per_sample * interval["samples_per_s"] / (2 * 1e9), rel=1e-5)
    evals = [r for r in records if r["event"] == "eval"]
    assert [(r["step"], r["val_loss"]) for r in evals] == [(8, 0.5), (8, 0.5)]
    assert [r["val_loss"] for r in records if r["event"] == "epoch"] == [0.5]
    start = records[0]
    assert start["flops_per_sample"] == per_sample and start["peak_flops"] == 2e9


def test_intervals_at_every_flush_and_the_printed_line(tmp_path, capsys):
    _, records = gpt_run(tmp_path, log_every=5, stop_check_every=3, max_steps=14,
                         tensorboard_dir=None)
    intervals = [(r["step"], r["steps"]) for r in records if r["event"] == "interval"]
    # log_every 5, the stop check every 3, the epoch's end at 8, the run's at 14
    assert intervals == [(3, 3), (5, 2), (6, 1), (8, 2), (9, 1), (10, 1), (12, 2), (14, 2)]
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    # log_every's two lines, then the validation at the last step (between epochs' ends)
    assert len(lines) == 3 and lines[0].startswith("step 5  loss ")
    assert lines[2] == "step 14  loss 0.0714  val_loss 0.5000  val_accuracy 0.0000"
    for word in ("lr ", " samples/s (", " tokens/s)", "  step ", " ms  input ", "grad_norm ",
                 "loss_scale 1024", "mfu n/a"):
        assert word in lines[0], lines[0]


def test_interval_arithmetic_with_a_given_clock():
    ticks = iter([0.0, 0.001, 0.1, 0.1015, 0.3, 0.302, 0.5])  # 3 steps, then the flush

    class Loader:
        def get(self, idx):
            return idx

    meter = IntervalMeter(world_size=4, global_batch=32, tokens_per_sample=None,
                          flops_per_sample=100.0, peak_flops=1e4, clock=lambda: next(ticks))
    for i in range(3):
        meter.load(Loader(), i)
    record = meter.interval(3, [0.1, 0.2, None], [], [])
    assert record["samples_per_s"] == pytest.approx(3 * 32 / 0.5)
    assert record["step_time_s"] == pytest.approx(0.2)  # median of 0.1, 0.2, 0.2
    assert record["input_wait_s"] == pytest.approx((0.001 + 0.0015 + 0.002) / 3)
    assert record["mfu"] == pytest.approx(100 * 192 / 1e4)
    assert "lr" not in record and "tokens_per_s" not in record and "grad_norm" not in record
    assert meter.interval(3, [], [], []) is None  # nothing timed since


def test_flops_of_the_spec_models_counted_by_hand():
    assert training_flops_per_sample(toolkit.MLP((64, 128, 10))) == 3 * 2 * (64 * 128
                                                                             + 128 * 10)
    cnn = toolkit.CNN(image_shape=(8, 8, 1), channels=(8, 4), classes=10)
    convs = 8 * 8 * 9 * 1 * 8 + 8 * 8 * 9 * 8 * 4  # H x W x k x k x C_in x C_out each
    assert training_flops_per_sample(cnn) == 3 * 2 * (convs + 8 * 8 * 4 * 10)
    # GPT: embeddings, 2 blocks (ln, qkv, proj, ln, fc, proj), ln_f; the head is tied to
    # the token embedding
    block = 64 + (32 * 96 + 96) + (32 * 32 + 32) + 64 + (32 * 128 + 128) + (128 * 32 + 32)
    params = 256 * 32 + 16 * 32 + 2 * block + 64
    assert GPT.num_params == params
    assert training_flops_per_sample(GPT) == (6 * params + 12 * 2 * 32 * 16) * 16
    assert training_flops_per_sample(object()) is None


def test_peaks_of_known_gpus(tmp_path):
    assert peak_flops("NVIDIA H100 80GB HBM3", "bfloat16") == 989.4e12
    assert peak_flops("NVIDIA H100 80GB HBM3", "float32") == 67e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", "float32") == 19.5e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", "tf32") == 156e12
    assert peak_flops("Tesla V100-SXM2-16GB", "bfloat16") is None
    assert peak_flops("Tesla T4", "float32") is None
    assert device_peak(["cuda:0"], "bfloat16", ["NVIDIA H100 80GB HBM3"])[0] == 989.4e12
    peak, why = device_peak(["cpu"], "float32")
    assert peak is None and "--peak-flops" in why
    assert device_peak(["gpu:0"], "float32", ["NVIDIA A100", "NVIDIA H100"])[0] is None
    gpu = tmp_path / "0000:18:00.0"
    gpu.mkdir()
    (gpu / "information").write_text("Model: \t\t NVIDIA H100 80GB HBM3\nIRQ: 10\n")
    assert gpu_models(tmp_path) == ["NVIDIA H100 80GB HBM3"]
    assert gpu_models(tmp_path / "none") == []


def test_native_optimizers_lr_where_it_can_be_read():
    class Torchish:
        param_groups = [{"lr": 0.25}]

    class Kerasish:
        learning_rate = np.float32(0.5)

    assert native_lr(Torchish()) == 0.25 and native_lr(Kerasish()) == 0.5
    assert native_lr((lambda p: p, lambda g, s, p: (g, s))) is None  # optax: a pair
    assert native_lr((Torchish(), object())) == 0.25  # torch's (optimizer, scheduler) pair


@pytest.mark.parametrize("kwargs, match", [
    (dict(peak_flops=-1.0), "peak_flops=-1.0 is not a positive number"),
    (dict(flops_per_sample=0), "flops_per_sample=0 is not a positive number"),
])
def test_bad_mfu_options(kwargs, match):
    with pytest.raises(ToolkitError, match=match):
        toolkit.Trainer(SteadyBackend(), GPT, toolkit.SGD(lr=0.1), global_batch_size=8,
                        env=toolkit.LaunchEnv(), **kwargs)


def test_a_tensorboard_dir_that_is_a_file(tmp_path):
    (tmp_path / "tb").write_text("")
    with pytest.raises(ToolkitError, match="tensorboard_dir .* is a file") as err:
        toolkit.Trainer(SteadyBackend(), GPT, toolkit.SGD(lr=0.1), global_batch_size=8,
                        env=toolkit.LaunchEnv(), tensorboard_dir=tmp_path / "tb")
    assert "HINT" in str(err.value) or "--tensorboard" in str(err.value)


def test_a_missing_tensorboard_package_is_named_with_its_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ToolkitError, match="needs the tensorboard package") as err:
        toolkit.Trainer(SteadyBackend(), GPT, toolkit.SGD(lr=0.1), global_batch_size=8,
                        env=toolkit.LaunchEnv(), tensorboard_dir=tmp_path / "tb")
    assert "pip install tensorboard" in str(err.value)


def test_native_model_leaves_mfu_out_saying_why():
    from toolkit.trainer.metrics import mfu_facts

    facts = mfu_facts(object(), None, 1e12, ["cpu"], "float32", 2)
    assert facts["flops_per_sample"] is None and "flops_per_sample=" in facts["mfu_words"]
    given = mfu_facts(object(), 10.0, 1e12, ["cpu"], "float32", 2)
    assert given["peak_flops"] == 2e12 and given["flops_per_sample"] == 10.0


def test_tensorboard_events_read_back_equal_the_metrics_log(tmp_path, tensorboard_events):
    _, records = gpt_run(tmp_path, peak_flops=1e9)
    events = tensorboard_events(tmp_path / "tb")

    def scalars(tag):
        return [(e.step, e.value) for e in events.Scalars(tag)]

    def logged(kind, field):
        return [(r["step"], r[field]) for r in records if r["event"] == kind and field in r]

    for tag, kind in (("loss", "step"), ("samples_per_s", "interval"),
                      ("tokens_per_s", "interval"), ("step_time_s", "interval"),
                      ("lr", "interval"), ("grad_norm", "interval"),
                      ("loss_scale", "interval"), ("mfu", "interval"), ("val_loss", "eval")):
        got, want = scalars(tag), logged(kind, tag)
        assert [s for s, _ in got] == [s for s, _ in want], tag
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6), tag


def test_a_final_evaluation_has_its_own_tags_and_counts_are_no_scalars(tmp_path,
                                                                        tensorboard_events):
    """train_gpt's periodic and final evaluations at one step: the final one's values under
    ``final/``; how many windows each evaluated is in the metrics log, not a curve."""
    from toolkit.trainer.tensorboard import TensorBoardLog

    tb = TensorBoardLog(tmp_path / "tb", rank=0)
    tb.write({"event": "eval", "step": 20, "time": 1.0, "val_loss": 2.5, "val_windows": 256})
    tb.write({"event": "eval", "step": 20, "time": 2.0, "val_loss": 2.4, "val_windows": 9000,
              "final": True})
    tb.close()
    events = tensorboard_events(tmp_path / "tb")
    assert sorted(events.Tags()["scalars"]) == ["final/val_loss", "val_loss"]
    assert [(e.step, e.value) for e in events.Scalars("final/val_loss")] == [
        (20, pytest.approx(2.4))]


def test_no_control_characters_when_stderr_is_a_file(tmp_path):
    with open(tmp_path / "err.txt", "w") as err:
        saved, sys.stderr = sys.stderr, err
        try:
            gpt_run(tmp_path, progress=True, max_steps=5)
        finally:
            sys.stderr = saved
    text = (tmp_path / "err.txt").read_text()
    assert "\r" not in text and "\x1b" not in text


def test_the_progress_bar_on_a_terminal_shows_and_ends_cleanly():
    import pty

    script = ("import time; from toolkit.trainer.history import ProgressLine\n"
              "p = ProgressLine(True, max_steps=3, global_batch=64)\n"
              "for s in (1, 2, 3):\n"
              "    time.sleep(0.25); p.update(s, 0, s, 100, 1.0 / s)\n"
              "p.clear(); print('after')\n")
    pid, fd = pty.fork()
    if pid == 0:  # the child, on the pty
        os.execve(sys.executable, [sys.executable, "-c", script],
                  {**os.environ, "PYTHONPATH": os.getcwd()})
    out = b""
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # the child closed the pty
            break
        if not chunk:
            break
        out += chunk
    assert os.waitpid(pid, 0)[1] == 0, out
    text = out.decode()
    assert "step 3/3  loss 0.3333" in text and " samples/s" in text and "ETA" in text, text
    assert text.rstrip().endswith("after"), text  # the bar removed itself before the print


def test_a_step_in_flight_is_timed_when_it_is_seen_finished(monkeypatch):
    """Asynchronous dispatch: a step's time is when its loss was seen ready (polled after
    each step) or, at the latest, when the flush's float() returned it."""
    from toolkit.trainer.guard import DivergenceGuard
    from toolkit.trainer.history import History, MetricsLog
    from toolkit.trainer.losses import StepLosses

    class InFlight:
        def __init__(self, value):
            self.value, self.ready = value, False

        def is_ready(self):
            return self.ready

        def __float__(self):
            self.ready = True
            return self.value

    clock = iter(range(100, 200))
    monkeypatch.setattr("toolkit.trainer.losses.time.time", lambda: float(next(clock)))
    losses = StepLosses(History(), DivergenceGuard(None, 20, 5), MetricsLog(None, 0))
    first, second = InFlight(1.0), InFlight(2.0)
    losses.add(toolkit.StepResult(first))  # t=100: in flight
    first.ready = True
    losses.add(toolkit.StepResult(second))  # t=101: the first is seen finished
    losses.add(toolkit.StepResult(3.0))  # t=102: a plain value, behind the second
    assert losses.times == [101.0, None, None]
    written = []
    losses.log.write = lambda records: written.extend(records)
    losses.flush(3, None)
    assert [r["time"] for r in written] == [101.0, 103.0, 104.0]  # float() waited for them
    assert losses.history.losses == [1.0, 2.0, 3.0]


class OverflowingBackend(LrRecorder):
    """Every step's scaled gradient overflows: the loss scaler (the toolkit's, as every
    backend's update path keeps it) skips the step and halves its scale, from 4 to 1 and on
    below 1; the loss stays finite."""

    name = "overflowing"

    def build(self, model, optimizer, loss, *, seed=0, clip_grad_norm=None, **options):
        super().build(model, optimizer, loss, seed=seed, **options)
        self.scaler = LossScaler(init_scale=4.0)

    def train_step(self, x, y, lr):
        used = self.scaler.scale
        self.scaler.update(finite=False)
        return toolkit.StepResult(0.5, grad_norm=float("inf"), skipped=True, loss_scale=used,
                                  overflow=True)


def test_a_loss_scale_of_one_and_below_is_still_the_scalers(tmp_path):
    """A scale of exactly 1.0 (and 0.5, 0.25) is a scaler's: its overflow skips are the
    scaler's, logged as such, and the divergence guard does not stop the run for their
    non-finite gradient norms."""
    trainer = toolkit.Trainer(OverflowingBackend(), toolkit.MLP((4, 2)), toolkit.SGD(lr=0.1),
                              global_batch_size=4, max_steps=5, progress=False,
                              env=toolkit.LaunchEnv(), metrics_log=tmp_path / "m.jsonl",
                              clip_grad_norm=1.0)
    x = np.zeros((16, 4), np.float32)
    history = trainer.fit(x, np.zeros(16, np.int64))
    assert history.loss_scales == [4.0, 2.0, 1.0, 0.5, 0.25]
    assert history.overflow_steps == [1, 2, 3, 4, 5]
    steps = [r for r in records_of(tmp_path / "m.jsonl") if r["event"] == "step"]
    assert [(r["loss_scale"], r.get("overflow")) for r in steps] == [
        (4.0, True), (2.0, True), (1.0, True), (0.5, True), (0.25, True)]


def test_without_a_scaler_no_loss_scale_is_logged(tmp_path):
    trainer, records = gpt_run(tmp_path, max_steps=3)
    assert all("loss_scale" in r for r in records if r["event"] == "step")  # (1024: a scaler's)
    trainer = toolkit.Trainer(SteadyBackend(), GPT, toolkit.SGD(lr=0.1), global_batch_size=8,
                              max_steps=3, progress=False, env=toolkit.LaunchEnv(),
                              metrics_log=tmp_path / "plain.jsonl")
    history = trainer.fit(tokens())
    assert history.loss_scales == [] and history.overflow_steps == []
    assert not any("loss_scale" in r for r in records_of(tmp_path / "plain.jsonl"))
