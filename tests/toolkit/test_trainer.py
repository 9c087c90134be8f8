"""The Trainer's loop, metrics and options, on a real backend in this process (one rank)."""

import json

import numpy as np
import pytest

import adapters
import toolkit
from toolkit.datasets import load_digits


@pytest.fixture(scope="module")
def digits():
    return load_digits()


def make(**kw):
    options = dict(global_batch_size=64, progress=False, env=toolkit.LaunchEnv())
    options.update(kw)
    return toolkit.Trainer(adapters.get("horovod-torch"), toolkit.MLP((64, 32, 10)),
                           toolkit.SGD(lr=0.05, momentum=0.9), **options)


def test_epochs_validation_and_metrics_log(digits, tmp_path):
    (x, y), val = digits
    log = tmp_path / "m.jsonl"
    history = make(epochs=2, metrics_log=log).fit(x, y, val)
    steps_per_epoch = len(x) // 64
    assert len(history.losses) == 2 * steps_per_epoch
    assert [e["epoch"] for e in history.epochs] == [0, 1]
    assert history.epochs[1]["step"] == 2 * steps_per_epoch
    assert 0.5 < history.epochs[1]["val_accuracy"] <= 1.0
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records if r["event"] == "step"] == list(
        range(1, 2 * steps_per_epoch + 1))
    assert [r["loss"] for r in records if r["event"] == "step"] == history.losses
    assert sum(r["event"] == "epoch" for r in records) == 2


def test_validation_is_exact(digits):
    (x, y), val = digits
    trainer = make(max_steps=5)
    trainer.fit(x, y)
    result = trainer.evaluate(*val)
    logits = toolkit.MLP((64, 32, 10)).apply(
        {k[7:]: v for k, v in trainer.adapter.state_dict().items() if k.startswith("params/")},
        val[0])
    assert result["val_accuracy"] == pytest.approx(np.mean(logits.argmax(1) == val[1]))


def test_accumulation_and_lr_scaling(digits):
    (x, y), _ = digits
    plain = make(max_steps=6).fit(x, y).losses
    accumulated = make(max_steps=6, accumulation_steps=4).fit(x, y).losses
    np.testing.assert_allclose(accumulated, plain, rtol=1e-5)
    # One rank: every scaling mode is the identity.
    np.testing.assert_allclose(make(max_steps=6, lr_scaling="linear").fit(x, y).losses, plain,
                               rtol=1e-6)


class LrRecorder:
    """A numpy stand-in for a backend that records the learning rate of every train_step; its
    collectives are those of one process, so it can play any rank of a larger LaunchEnv."""

    name = "lr-recorder"

    def __init__(self):
        self.lrs: list[float] = []

    def setup(self, env, layout=None):
        self.env = env

    def build(self, model, optimizer, loss, *, seed=0, accumulation_steps=1,
              sync_batchnorm=False, metrics=None):
        self.params = model.init(seed)

    def train_step(self, x, y, lr):
        self.lrs.append(lr)
        return 0.0

    def evaluate(self, x, y):
        return {"loss_sum": 0.0, "count": float(len(x))}

    def allreduce(self, values, op="mean"):
        return np.asarray(values, np.float64)

    def broadcast(self, values, root=0):
        return np.asarray(values)

    def barrier(self):
        pass

    def sync_state(self):
        pass

    def state_dict(self):
        return {f"params/{k}": v for k, v in self.params.items()}

    def load_state_dict(self, state):
        self.params = {k[7:]: v for k, v in state.items()}

    def shutdown(self):
        pass


@pytest.mark.parametrize("mode, world_size, lr", [
    ("none", 2, 0.05), ("none", 4, 0.05),
    ("linear", 2, 0.1), ("linear", 4, 0.2),  # base x N
    ("sqrt", 2, 0.05 * 2 ** 0.5), ("sqrt", 4, 0.1),  # base x sqrt(N)
])
def test_lr_scaling_multiplies_the_lr_on_larger_worlds(digits, mode, world_size, lr):
    """The lr each train_step receives on every rank of a world of 2 or 4 (base lr 0.05)."""
    (x, y), _ = digits
    for rank in (0, world_size - 1):
        adapter = LrRecorder()
        env = toolkit.LaunchEnv(world_size=world_size, rank=rank, local_size=world_size,
                                local_rank=rank)
        toolkit.Trainer(adapter, toolkit.MLP((64, 32, 10)), toolkit.SGD(lr=0.05),
                        global_batch_size=64, max_steps=3, progress=False, env=env,
                        lr_scaling=mode).fit(x, y)
        assert adapter.lrs == pytest.approx([lr] * 3, rel=1e-12)


class BatchRecorder(LrRecorder):
    """Also records the samples of every train_step (inputs are sample ids)."""

    def __init__(self):
        super().__init__()
        self.batches: list[list[int]] = []

    def train_step(self, x, y, lr):
        self.batches.append([int(v) for v in np.asarray(x)[:, 0]])
        return super().train_step(x, y, lr)


def batches_of_each_rank(world_size, samples, epochs, **kw):
    """The sample ids each rank of ``world_size`` trains on, step by step."""
    x = np.arange(samples, dtype=np.float32)[:, None].repeat(3, axis=1)
    y = np.zeros(samples, np.int64)
    out = []
    for rank in range(world_size):
        adapter = BatchRecorder()
        env = toolkit.LaunchEnv(world_size=world_size, rank=rank, local_size=world_size,
                                local_rank=rank)
        toolkit.Trainer(adapter, toolkit.MLP((3, 2)), toolkit.SGD(lr=0.1), global_batch_size=4,
                        epochs=epochs, progress=False, env=env, **kw).fit(x, y)
        out.append(adapter.batches)
    return out


def test_without_shuffling_the_trainer_takes_samples_in_order_every_epoch():
    ranks = batches_of_each_rank(2, 10, epochs=2, shuffle=False)  # 2 steps, 2 samples left out
    assert ranks[0] == [[0, 2], [4, 6]] * 2
    assert ranks[1] == [[1, 3], [5, 7]] * 2


def test_drop_last_false_pads_the_last_batch_from_the_start_of_the_epoch():
    ranks = batches_of_each_rank(2, 10, epochs=1, shuffle=False, drop_last=False)
    assert ranks[0] == [[0, 2], [4, 6], [8, 0]]
    assert ranks[1] == [[1, 3], [5, 7], [9, 1]]
    # shuffled: every sample once per epoch, the padding taken from the same epoch's order
    ranks = batches_of_each_rank(2, 10, epochs=2, shuffle=True, drop_last=False)
    for epoch in range(2):
        steps = [ranks[0][3 * epoch + s] + ranks[1][3 * epoch + s] for s in range(3)]
        seen = [i for step in steps for i in step]
        assert len(seen) == 12 and set(seen) == set(range(10)), seen
        twice = sorted(i for i in set(seen) if seen.count(i) == 2)
        # the repeated samples are the epoch's first two: rank 0's and rank 1's first
        assert twice == sorted([ranks[0][3 * epoch][0], ranks[1][3 * epoch][0]]), steps
    assert ranks[0][:3] != ranks[0][3:]  # each epoch its own order


@pytest.mark.parametrize("kwargs, match", [
    (dict(accumulation_steps=3), "does not split into accumulation_steps=3"),
    (dict(accumulation_steps=0), "accumulation_steps=0 must be >= 1"),
    (dict(lr_scaling="cubic"), "unknown lr scaling 'cubic'"),
    (dict(resume="latest"), "resume='latest' needs a checkpoint directory"),
    (dict(global_batch_size=5000), "larger than the data set"),
    (dict(stop_signals=("SIGNOPE",), checkpoint_dir="x"), "unknown signal 'SIGNOPE'"),
    (dict(eval_every=0), "eval_every=0 must be >= 1"),
])
def test_bad_options(digits, kwargs, match):
    (x, y), _ = digits
    with pytest.raises(toolkit.ToolkitError, match=match):
        make(max_steps=2, **kwargs).fit(x, y)


def test_mismatched_lengths(digits):
    (x, y), _ = digits
    with pytest.raises(toolkit.ToolkitError, match="x has 1438 samples but y has 10"):
        make(max_steps=1).fit(x, y[:10])


def test_checkpoint_every_seconds_and_keep(digits, tmp_path):
    (x, y), _ = digits
    trainer = make(max_steps=40, checkpoint_dir=tmp_path, checkpoint_every_seconds=0.0,
                   keep=2)
    trainer.fit(x, y)
    steps = [int(p.name.split("_")[1]) for p in toolkit.CheckpointStore(tmp_path).checkpoints()]
    assert steps == [39, 40]  # one after every step, the last two kept


class _Terminal:
    """A stderr that says it is a terminal and keeps what the progress line writes."""

    def __init__(self):
        self.text = ""

    def isatty(self):
        return True

    def write(self, text):
        self.text += text

    def flush(self):
        pass


def test_progress_line_counts_the_runs_steps_with_max_steps_else_the_epochs(monkeypatch):
    from toolkit.trainer.history import ProgressLine

    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    ProgressLine(True, max_steps=200).update(101, 0, 101, 116988, 2.5)
    assert "step 101/200  loss 2.5000" in terminal.text and "116988" not in terminal.text
    terminal.text = ""
    ProgressLine(True).update(101, 0, 101, 116988, 2.5)
    assert "epoch 0  101/116988 steps  loss 2.5000" in terminal.text
    assert ProgressLine(True, max_steps=0).enabled  # shown on a terminal only
    monkeypatch.setattr("sys.stderr", type("Pipe", (_Terminal,), {"isatty": lambda s: False})())
    assert not ProgressLine(True).enabled


def test_trainer_progress_shows_max_steps_set_between_fits(digits, monkeypatch):
    """As examples/train_gpt.py trains in intervals: the line counts global steps towards the
    Trainer's max_steps of that fit, not the epoch's steps."""
    (x, y), _ = digits
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    trainer = make(max_steps=3, progress=True)
    trainer.fit(x, y)
    assert "step 1/3" in terminal.text and "step 3/3" in terminal.text
    trainer.max_steps = 6
    trainer.fit(x, y)
    assert "step 4/6" in terminal.text and "step 6/6" in terminal.text
    assert f"/{len(x) // 64} steps" not in terminal.text


def test_trainer_progress_with_epochs_counts_each_epochs_steps(digits, monkeypatch):
    (x, y), _ = digits
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    make(epochs=2, progress=True).fit(x, y)
    per_epoch = len(x) // 64
    for epoch in (0, 1):  # an epoch's last step is shown as its last, not as 0/N
        assert f"epoch {epoch}  {per_epoch}/{per_epoch} steps" in terminal.text
    assert f"  0/{per_epoch} steps" not in terminal.text


def test_console_metrics_log_and_checkpoint_count_epochs_from_0(digits, tmp_path, capsys):
    """One convention: the epoch line's number, the metrics log's and a checkpoint's
    ``epoch`` (the sampler's) name the same epoch."""
    (x, y), _ = digits
    log = tmp_path / "m.jsonl"
    per_epoch = len(x) // 64
    make(epochs=2, metrics_log=log, checkpoint_dir=tmp_path / "ck", keep=5,
         checkpoint_every=per_epoch + 3).fit(x, y)
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("epoch ")]
    assert [line.split()[:4] for line in lines] == [
        ["epoch", "0", "step", str(per_epoch)], ["epoch", "1", "step", str(2 * per_epoch)]]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(r["epoch"], r["step"]) for r in records if r["event"] == "epoch"] == [
        (0, per_epoch), (1, 2 * per_epoch)]
    mid = toolkit.CheckpointStore(tmp_path / "ck").load(
        tmp_path / "ck" / f"step_{per_epoch + 3:09d}")
    assert mid.meta["epoch"] == 1  # in the epoch the console and the log call 1


@pytest.mark.parametrize("options, evaluated", [
    (dict(max_steps=5), [5]),  # stopped before the epoch's end: evaluated there
    (dict(max_steps=5, eval_every=2), [2, 4, 5]),
    (dict(max_steps=6, eval_every=3), [3, 6]),  # (the last step once)
    (dict(epochs=2, eval_every=4), [4, 8, 11, 12, 16, 20, 22]),  # 11 steps an epoch
    (dict(epochs=1), [11]),  # the epoch's end only
])
def test_validation_is_evaluated_every_eval_every_steps_and_at_the_last(
        digits, tmp_path, capsys, options, evaluated):
    (x, y), validation = digits
    trainer = toolkit.Trainer(LrRecorder(), toolkit.MLP((64, 32, 10)), toolkit.SGD(lr=0.05),
                              global_batch_size=128, progress=False, env=toolkit.LaunchEnv(),
                              metrics_log=tmp_path / "m.jsonl", **options)
    history = trainer.fit(x, y, validation)
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["event"] == "eval"] == evaluated
    assert [e["step"] for e in history.evaluations] == evaluated
    assert all(e["val_loss"] == 0.0 for e in history.evaluations)  # (LrRecorder's)
    ends = {r["step"] for r in records if r["event"] == "epoch"}
    between = [s for s in evaluated if s not in ends]
    lines = [line for line in capsys.readouterr().out.splitlines() if " val_loss " in line]
    assert [line.split()[1] for line in lines if line.startswith("step ")] == \
        [str(s) for s in between]


def test_a_fit_with_nothing_left_to_train_still_evaluates_the_model_it_returns(digits, capsys):
    (x, y), validation = digits
    trainer = toolkit.Trainer(LrRecorder(), toolkit.MLP((64, 32, 10)), toolkit.SGD(lr=0.05),
                              global_batch_size=128, max_steps=3, progress=False,
                              env=toolkit.LaunchEnv())
    trainer.fit(x, y, validation)
    again = trainer.fit(x, y, validation)  # (max_steps reached: no step)
    assert again.losses == [] and [e["step"] for e in again.evaluations] == [3]
    lines = [line for line in capsys.readouterr().out.splitlines() if "val_loss" in line]
    assert lines[-1].startswith("step 3  val_loss ")  # (no training loss to show)


def test_the_state_at_the_end_is_saved_unless_this_directory_has_it(digits, tmp_path):
    """Whether the end of training writes a checkpoint is decided from what this run wrote or
    resumed from its own directory, never by looking at the directory (where rank 0's write
    of the last step may still be under way when another rank looks: that rank would save
    alone and wait for the others forever)."""
    (x, y), _ = digits
    trainer = make(max_steps=4, checkpoint_dir=tmp_path / "a", checkpoint_every=4)
    trainer.fit(x, y)
    assert not trainer.checkpoints.unsaved(4)  # written by the schedule at the last step
    # as another rank sees the directory while rank 0 still writes that step
    trainer.checkpoints.store.checkpoints = lambda: []
    assert not trainer.checkpoints.unsaved(4)
    again = make(max_steps=4, checkpoint_dir=tmp_path / "a", resume="auto")
    again.fit(x, y)
    assert not again.checkpoints.unsaved(4)  # resumed from its own directory at step 4
    elsewhere = make(max_steps=4, checkpoint_dir=tmp_path / "b",
                     resume=str(toolkit.CheckpointStore(tmp_path / "a").checkpoints()[-1]))
    elsewhere.fit(x, y)  # resumed from another run's directory: the state goes to its own
    assert [p.name for p in toolkit.CheckpointStore(tmp_path / "b").checkpoints()] == \
        [toolkit.CheckpointStore(tmp_path / "a").checkpoints()[-1].name]
