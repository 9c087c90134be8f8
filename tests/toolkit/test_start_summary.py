"""What runs is said before the first step (rank 0), and is the metrics log's first record."""

import json

import pytest

import adapters
import toolkit
from toolkit.datasets import load_digits


@pytest.mark.parametrize(("layout", "world", "local", "words"), [
    (toolkit.DataParallel(), 4, 1, "data parallel over 4 device(s)"),
    (toolkit.Sharded(3, tensor_parallel=2), 4, 1, "sharded:3:tp2 (ZeRO-3) over data=2 x model=2"),
    (toolkit.Sharded(2), 2, 2, "sharded:2 (ZeRO-2) over data=4"),
    (toolkit.Pipeline(2, 4, "gpipe"), 4, 1,
     "pipeline of 2 stages x 2 replica(s), 4 micro-batches, gpipe"),
])
def test_each_layout_says_itself_in_words(layout, world, local, words):
    assert layout.describe(world, local) == words


def test_the_start_is_said_and_logged_with_what_it_resumes(tmp_path, capsys):
    (x, y), _ = load_digits()

    def run(steps, **kw):
        toolkit.Trainer(adapters.get("horovod-torch"), toolkit.MLP((64, 16, 10)),
                        toolkit.SGD(lr=0.1), global_batch_size=64, max_steps=steps,
                        accumulation_steps=2, progress=False, env=toolkit.LaunchEnv(),
                        checkpoint_dir=tmp_path / "ckpt", metrics_log=tmp_path / "log.jsonl",
                        **kw).fit(x, y)
        return capsys.readouterr().out

    with pytest.raises(toolkit.ToolkitError, match="--resume latest: the checkpoint directory "
                       ".*ckpt does not exist\nHINT: check the path .* --resume auto"):
        run(3, resume="latest")  # nothing to resume: a mistyped path never starts over
    assert not (tmp_path / "ckpt").exists()
    out = run(3, resume="auto")  # nothing to resume yet: a new run, said so
    for line in ("backend     horovod-torch, float32",
                 "layout      data parallel over 1 device(s)",
                 "world       1 rank(s) on 1 node(s), 1 per node; devices per rank: cpu",
                 "batch       global 64, local 64 per data share, micro 32",
                 f"model       MLP, {64 * 16 + 16 + 16 * 10 + 10:,} parameters",
                 f"data        {len(x):,} samples, {len(x) // 64} steps per epoch",
                 f"checkpoints {tmp_path / 'ckpt'}: NEW RUN from step 0 (no checkpoint there "
                 "to resume)"):
        assert line in out.splitlines(), (line, out)
    out = run(5, resume="latest")
    assert (f"checkpoints {tmp_path / 'ckpt'}: RESUMED at step 3 from "
            f"{tmp_path / 'ckpt' / 'step_000000003'}") in out.splitlines(), out
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    starts = [r for r in records if r["event"] == "start"]
    assert records[0]["event"] == "start" and len(starts) == 2
    assert starts[0]["parameters"] == 64 * 16 + 16 + 16 * 10 + 10
    assert starts[0]["micro_batch"] == 32 and starts[0]["start_step"] == 0
    assert starts[1]["start_step"] == 3 and starts[1]["resumed_from"].endswith("step_000000003")


@pytest.mark.parametrize(("contents", "found"), [
    ((), "the checkpoint directory {d} is empty"),
    (("notes.txt", "step_000000004.tmp/"),
     "{d} holds no checkpoint (it holds notes.txt, step_000000004.tmp/)"),
])
def test_resume_latest_refuses_a_directory_without_a_checkpoint(tmp_path, capsys, contents,
                                                                 found):
    (x, y), _ = load_digits()
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for name in contents:
        (ckpt / name).mkdir() if name.endswith("/") else (ckpt / name).write_text("mine")

    def run(resume):
        toolkit.Trainer(adapters.get("horovod-torch"), toolkit.MLP((64, 10)),
                        toolkit.SGD(lr=0.1), global_batch_size=64, max_steps=1, progress=False,
                        env=toolkit.LaunchEnv(), checkpoint_dir=ckpt, resume=resume).fit(x, y)

    with pytest.raises(toolkit.ToolkitError) as err:
        run("latest")
    assert str(err.value).splitlines()[0] == "--resume latest: " + found.format(d=ckpt)
    assert sorted(p.name for p in ckpt.iterdir()) == sorted(n.rstrip("/") for n in contents)
    assert (ckpt / "notes.txt").read_text() == "mine" if contents else True  # nothing touched
    run("auto")  # a requeued job's first start: a new run, said so
    assert "NEW RUN from step 0" in capsys.readouterr().out
    run("latest")  # now there is one
    assert f"RESUMED at step 1 from {ckpt / 'step_000000001'}" in capsys.readouterr().out


@pytest.mark.slow
def test_the_block_is_printed_once_per_job(launch):
    job = launch("mpirun", 2, ["examples/train_digits.py", "--steps", "2", "--layout",
                               "sharded:2"], timeout=180)
    assert job.returncode == 0, job
    assert job.stdout.count("backend     horovod-torch, float32") == 1, job
    assert "world       2 rank(s) on 1 node(s), 2 per node; devices per rank: cpu" in job.stdout
    assert "layout      sharded:2 (ZeRO-2) over data=2" in job.stdout
    assert "batch       global 64, local 32 per data share, micro 32" in job.stdout


def test_each_layout_says_its_micro_batch():
    assert toolkit.DataParallel().micro_batch(32, accumulation_steps=4) == 8
    assert toolkit.Sharded(2).micro_batch(32, accumulation_steps=2) == 16
    assert toolkit.Pipeline(2, micro_batches=8).micro_batch(32) == 4
