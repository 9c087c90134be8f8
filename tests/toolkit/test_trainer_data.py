"""The Trainer on data sets (TokenWindows, arrays), with and without the prefetch thread, on a
numpy backend: the reference arithmetic behind the adapter contract, no framework needed."""

import json
import os
import signal
import threading
import time

import numpy as np
import pytest

import toolkit
from toolkit import GPT, MLP, SGD, ArrayDataset, CheckpointError, TokenWindows, ToolkitError
from toolkit.models.reference import apply_update, init_state, reference_run

MODEL = GPT(vocab=64, context=8, width=16, layers=1, heads=2)
OPTIMIZER = SGD(lr=0.1, momentum=0.9)
BATCH = 8


class LazyLoss:
    """A loss the way JAX returns one: a scalar that is only a float once asked."""

    def __init__(self, value: float, adapter: "NumpyAdapter"):
        self.value, self.adapter = value, adapter

    def __float__(self) -> float:
        self.adapter.conversions += 1
        return self.value


class NumpyAdapter:
    """One rank in numpy. Counts what the Trainer asks of it."""

    name = "numpy"

    def __init__(self):
        self.steps = self.conversions = self.syncs = self.eval_calls = 0
        self.reduced: list[np.ndarray] = []

    def setup(self, env, layout=None):
        self.env = env

    def build(self, model, optimizer, loss, *, seed=0, accumulation_steps=1,
              sync_batchnorm=False, metrics=None):
        self.model, self.optimizer = model, optimizer
        self.params = model.init(seed, "float64")
        self.state = init_state(optimizer, self.params)

    def train_step(self, x, y, lr):
        value, grads = self.model.loss_and_grads(self.params, x, y)
        self.params, self.state = apply_update(self.optimizer, self.params, grads, self.state,
                                               lr)
        self.steps += 1
        return LazyLoss(value, self)

    def evaluate(self, x, y):
        self.eval_calls += 1
        logits = self.model.apply(self.params, x)
        shifted = logits - logits.max(-1, keepdims=True)
        logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
        y = np.asarray(y)
        per_sample = -np.take_along_axis(logp, y[..., None], -1).reshape(len(x), -1).mean(1)
        hits = (logits.argmax(-1) == y).reshape(len(x), -1).mean(1)
        return {"loss_sum": float(per_sample.sum()), "correct": float(hits.sum()),
                "count": float(len(x))}

    def allreduce(self, values, op="mean"):
        values = np.array(values, np.float64)
        self.reduced.append(values.copy())
        return values

    def broadcast(self, values, root=0):
        return np.asarray(values)

    def barrier(self):
        pass

    def sync_state(self):
        self.syncs += 1

    def state_dict(self):
        return {**{f"params/{k}": v.copy() for k, v in self.params.items()},
                **{k: np.array(v) for k, v in self.state.items()}}

    def load_state_dict(self, state):
        self.params = {k[7:]: v.copy() for k, v in state.items() if k.startswith("params/")}
        self.state = {k: v.copy() for k, v in state.items() if not k.startswith("params/")}

    def shutdown(self):
        pass


def make(adapter=None, model=MODEL, **kw):
    options = dict(global_batch_size=BATCH, progress=False, env=toolkit.LaunchEnv())
    options.update(kw)
    return toolkit.Trainer(adapter or NumpyAdapter(), model, OPTIMIZER, **options)


def corpus(seed=0, n=700):
    return np.random.default_rng(seed).integers(0, MODEL.vocab, n).astype(np.uint8)


def windows(tokens, context=8):
    """(x, y) arrays of the windows, sliced by hand."""
    starts = range(0, len(tokens) - context, context)
    x = np.array([tokens[s:s + context] for s in starts], np.int64)
    y = np.array([tokens[s + 1:s + context + 1] for s in starts], np.int64)
    return x, y


def prefetch_threads():
    return [t for t in threading.enumerate() if t.name == "toolkit-prefetch"]


@pytest.fixture
def data():
    return TokenWindows(corpus(0), 8, vocab=MODEL.vocab), TokenWindows(corpus(1, 300), 8,
                                                                      vocab=MODEL.vocab)


def test_prefetch_gives_the_same_losses_as_inline_loading_and_the_reference(data, tmp_path):
    train, val = data
    runs = {}
    for prefetch in (True, False):
        log = tmp_path / f"{prefetch}.jsonl"
        trainer = make(prefetch=prefetch, epochs=2, metrics_log=log)
        runs[prefetch] = (trainer.fit(train, validation=val), trainer)
        assert not prefetch_threads()
        stats = trainer.prefetch_stats
        assert stats["prefetch"] is prefetch and stats["batches"] == 2 * (len(train) // BATCH)
        assert 0.0 <= stats["hidden_fraction"] <= 1.0
        assert stats["hidden_fraction"] == 0.0 or prefetch
        records = [json.loads(line) for line in log.read_text().splitlines()]
        assert [r for r in records if r["event"] == "prefetch"][0]["batches"] == stats["batches"]
    (on, _), (off, _) = runs[True], runs[False]
    assert on.losses == off.losses and len(on.losses) == 2 * (len(train) // BATCH)
    assert [e["val_loss"] for e in on.epochs] == [e["val_loss"] for e in off.epochs]
    reference, _ = reference_run(MODEL, OPTIMIZER, "cross_entropy", *windows(corpus(0)),
                                 global_batch_size=BATCH, steps=len(on.losses))
    assert on.losses == reference


class Placed:
    """A batch 'on the device': what an adapter's device_batch hands train_step."""

    def __init__(self, array, thread):
        self.array, self.thread = array, thread


class PlacingAdapter(NumpyAdapter):
    """A backend with the PlacesBatches ability (as jax-pmap and jax-pjit have)."""

    def device_batch(self, x, y):
        return (Placed(x, threading.current_thread().name),
                Placed(y, threading.current_thread().name))

    def train_step(self, x, y, lr):
        assert isinstance(x, Placed) and isinstance(y, Placed)
        self.threads = getattr(self, "threads", []) + [x.thread]
        return super().train_step(x.array, y.array, lr)


@pytest.mark.parametrize("prefetch", [True, False])
def test_an_adapter_that_places_batches_gets_them_placed_in_the_prefetch_thread(data, prefetch):
    adapter = PlacingAdapter()
    assert isinstance(adapter, toolkit.contract.PlacesBatches)
    assert not isinstance(NumpyAdapter(), toolkit.contract.PlacesBatches)
    history = make(adapter, max_steps=9, prefetch=prefetch).fit(data[0])
    expected = "toolkit-prefetch" if prefetch else threading.current_thread().name
    assert adapter.threads == [expected] * 9
    assert history.losses == make(max_steps=9).fit(data[0]).losses


def test_auto_prefetch_loads_in_memory_arrays_inline_and_anything_else_in_the_thread(
        data, tmp_path):
    """The default, prefetch="auto": numpy arrays in memory load on the training thread; a
    data set or a memory-mapped array goes through the prefetch thread. Same batches either
    way."""
    x, y = windows(corpus(0))
    np.save(tmp_path / "x.npy", x)
    mapped = np.load(tmp_path / "x.npy", mmap_mode="r")

    class Subclass(toolkit.ArrayDataset):  # its batch() may do anything: the thread
        pass

    runs = {}
    for name, args in {"arrays": (x, y), "memmap": (mapped, y), "windows": (data[0],),
                       "memmap as array": (np.asarray(mapped), y),
                       "subclass": (Subclass(x, y),)}.items():
        adapter = PlacingAdapter()
        trainer = make(adapter, max_steps=9)
        assert trainer.prefetch == "auto"
        runs[name] = trainer.fit(*args).losses
        inline = name == "arrays"
        assert trainer.prefetch_stats["prefetch"] is not inline
        assert adapter.threads == [threading.current_thread().name if inline
                                   else "toolkit-prefetch"] * 9
    assert all(losses == runs["arrays"] for losses in runs.values())


@pytest.mark.parametrize("bad", ["yes", 1.5, None])
def test_a_bad_prefetch_value_is_a_clear_error(bad):
    with pytest.raises(toolkit.ToolkitError, match=r"prefetch=.* is not True, False or 'auto'"):
        make(prefetch=bad)


def test_the_loss_becomes_a_float_only_when_averaged(data):
    adapter = NumpyAdapter()
    history = make(adapter, max_steps=7, log_every=3).fit(data[0])
    assert adapter.conversions == adapter.steps == 7 and len(history.losses) == 7
    assert all(type(v) is float for v in history.losses)


@pytest.mark.parametrize("prefetch", [True, False])
def test_a_loader_exception_surfaces_with_its_message(data, prefetch):
    class Unreadable:
        def __init__(self, inner):
            self.inner, self.calls = inner, 0

        def __len__(self):
            return len(self.inner)

        def batch(self, indices):
            self.calls += 1
            if self.calls == 3:
                raise OSError("sample file 17 is unreadable")
            return self.inner.batch(indices)

    adapter = NumpyAdapter()
    with pytest.raises(OSError, match="sample file 17 is unreadable"):
        make(adapter, max_steps=6, prefetch=prefetch).fit(Unreadable(data[0]))
    assert adapter.steps == 2  # it surfaces at the step that needed the batch
    assert not prefetch_threads()


def test_a_batch_that_is_not_a_pair_is_named(data):
    class Triple:
        def __len__(self):
            return 100

        def batch(self, indices):
            return indices, indices, indices

    with pytest.raises(ToolkitError, match=r"Triple.batch\(\) returned a tuple, not a pair"):
        make(max_steps=2).fit(Triple())
    assert not prefetch_threads()


def test_resume_mid_epoch_with_prefetch_continues_the_same_run(data, tmp_path):
    train, _ = data
    straight = make(max_steps=14).fit(train).losses
    assert len(train) // BATCH == 10  # so the resume at step 4 is mid-epoch
    make(max_steps=4, checkpoint_dir=tmp_path).fit(train)
    resumed = make(max_steps=14, checkpoint_dir=tmp_path, resume="latest").fit(train)
    assert resumed.first_step == 4 and resumed.losses == straight[4:]


def test_a_stop_signal_with_prefetch_checkpoints_and_resumes(data, tmp_path):
    train, _ = data

    class SignalledAtStep5(NumpyAdapter):
        def train_step(self, x, y, lr):
            if self.steps == 4:
                os.kill(os.getpid(), signal.SIGUSR1)
            return super().train_step(x, y, lr)

    straight = make(max_steps=12).fit(train).losses
    before = {name: signal.getsignal(getattr(signal, name)) for name in ("SIGUSR1", "SIGTERM")}
    assert before["SIGUSR1"] == signal.SIG_DFL
    log = tmp_path / "m.jsonl"
    first = make(SignalledAtStep5(), max_steps=12, checkpoint_dir=tmp_path / "c", metrics_log=log)
    with pytest.raises(toolkit.TrainingPreempted, match="stopped by SIGUSR1 after step 5"):
        first.fit(train)
    assert not prefetch_threads()
    # the handlers are back, but a signal that came is ignored from then on (a second copy,
    # e.g. forwarded by a launcher, must not kill the rank while it reports)
    assert signal.getsignal(signal.SIGTERM) == before["SIGTERM"]
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
    signal.signal(signal.SIGUSR1, before["SIGUSR1"])
    assert first.prefetch_stats["batches"] == 5
    assert any(json.loads(line)["event"] == "prefetch" for line in log.read_text().splitlines())
    resumed = make(max_steps=12, checkpoint_dir=tmp_path / "c", resume="latest").fit(train)
    assert resumed.first_step == 5 and resumed.losses == straight[5:]


def test_resuming_onto_other_data_is_refused(tmp_path):
    a = TokenWindows(corpus(0), 8, vocab=MODEL.vocab)
    b = TokenWindows(corpus(7), 8, vocab=MODEL.vocab)  # as long, other bytes
    make(max_steps=3, checkpoint_dir=tmp_path).fit(a)
    manifest = tmp_path / "step_000000003" / "manifest.json"
    assert json.loads(manifest.read_text())["data_fingerprint"] == a.fingerprint
    with pytest.raises(CheckpointError) as err:
        make(max_steps=6, checkpoint_dir=tmp_path, resume="latest").fit(b)
    message = str(err.value)
    assert a.fingerprint in message and b.fingerprint in message
    assert "HINT: resume with the data it was trained on" in message
    with pytest.raises(CheckpointError, match="context=8, stride=4"):
        make(max_steps=6, checkpoint_dir=tmp_path, resume="latest").fit(
            TokenWindows(corpus(0), 8, stride=4, vocab=MODEL.vocab))
    # A checkpoint from before fingerprints were recorded still loads.
    meta = json.loads(manifest.read_text())
    del meta["data_fingerprint"]
    manifest.write_text(json.dumps(meta))
    history = make(max_steps=6, checkpoint_dir=tmp_path, resume="latest").fit(b)
    assert history.first_step == 3 and len(history.losses) == 3


def test_fit_with_arrays_still_works():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(96, 5)), rng.integers(0, 3, 96)
    mlp = MLP((5, 7, 3))
    history = make(model=mlp, epochs=2).fit(x, y, (x[:20], y[:20]))  # the old positional call
    assert len(history.losses) == 24 and len(history.epochs) == 2
    reference, _ = reference_run(mlp, OPTIMIZER, "cross_entropy", x, y,
                                 global_batch_size=BATCH, steps=24)
    assert history.losses == reference
    assert make(model=mlp, max_steps=3).fit(x, y).losses == reference[:3]
    assert make(model=mlp, max_steps=3).fit(ArrayDataset(x, y)).losses == reference[:3]
    with pytest.raises(ToolkitError, match="x has 96 samples but y has 10"):
        make(model=mlp, max_steps=1).fit(x, y[:10])


@pytest.mark.parametrize("args, match", [
    ((np.zeros((10, 5)),), r"the training data is a numpy.ndarray, which has no batch\(\)"),
    ((object(),), r"builtins.object, which has no __len__\(\) and no batch\(\)"),
    ((TokenWindows(corpus(), 8, vocab=64), TokenWindows(corpus(1), 8, vocab=64)),
     r"labels were passed too.*\nHINT: .*validation=val"),
])
def test_what_fit_refuses(args, match):
    with pytest.raises(ToolkitError, match=match):
        make(max_steps=1).fit(*args)


def test_evaluate_a_dataset_equals_evaluate_arrays(data):
    train, val = data
    adapter = NumpyAdapter()
    trainer = make(adapter, max_steps=5)
    trainer.fit(train)
    x, y = windows(corpus(1, 300))
    syncs = adapter.syncs
    whole = trainer.evaluate(x, y)
    assert adapter.syncs == syncs + 1  # every evaluation syncs first
    assert trainer.evaluate((x, y)) == whole
    assert trainer.evaluate(val) == whole  # the same one call of len(val) < 1024 samples
    chunked = make(adapter, max_steps=5, eval_batch_size=5)
    calls = adapter.eval_calls
    result = chunked.evaluate(val)
    assert adapter.eval_calls - calls == -(-len(val) // 5)
    assert result == pytest.approx(whole, rel=1e-12)


@pytest.mark.parametrize("world_size", [2, 3, 5])
def test_chunked_evaluation_is_exact_at_any_world_size(data, world_size):
    """Each rank's local sums (what it hands to allreduce) add up to one process's sums, and
    every rank makes the same number of adapter.evaluate calls."""
    _, val = data
    adapter = NumpyAdapter()
    adapter.build(MODEL, OPTIMIZER, "cross_entropy", seed=3)
    one = make(adapter, eval_batch_size=4)
    one.evaluate(val)
    total = adapter.reduced[-1]
    sums, calls = np.zeros(3), set()
    for rank in range(world_size):
        env = toolkit.LaunchEnv(world_size=world_size, rank=rank)
        before = adapter.eval_calls
        make(adapter, eval_batch_size=4, env=env).evaluate(val)
        sums += adapter.reduced[-1]
        calls.add(adapter.eval_calls - before)
    np.testing.assert_allclose(sums, total, rtol=1e-12)
    assert sums[2] == len(val) and len(calls) == 1


def test_prefetch_hides_loading_behind_compute(data):
    class SlowToRead:
        def __len__(self):
            return len(data[0])

        def batch(self, indices):
            time.sleep(0.02)
            return data[0].batch(indices)

    class SlowToTrain(NumpyAdapter):
        def train_step(self, x, y, lr):
            time.sleep(0.03)
            return super().train_step(x, y, lr)

    hidden = make(SlowToTrain(), max_steps=10)
    hidden.fit(SlowToRead())
    inline = make(SlowToTrain(), max_steps=10, prefetch=False)
    inline.fit(SlowToRead())
    assert hidden.prefetch_stats["load_seconds"] >= 0.2
    assert hidden.prefetch_stats["hidden_fraction"] > 0.5
    assert inline.prefetch_stats["hidden_fraction"] == 0.0
    assert inline.prefetch_stats["wait_seconds"] == inline.prefetch_stats["load_seconds"]
