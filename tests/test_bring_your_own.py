"""examples/bring_your_own/: a user's own torch, Keras and Flax CNN with BatchNorm, trained with
the framework's own optimizer and loss under real launchers. Each script learns, prints only
the toolkit's lines, once, and a run resumed from the checkpoint a killed job would have left
ends bit for bit where the uninterrupted run does (parameters, BatchNorm statistics, optimizer
state).

The uninterrupted run and the resumed one use different launchers (every launcher runs once),
so the checkpoint is also shown not to depend on the launcher.
"""

import json
import re
import shutil

import numpy as np
import pytest

from toolkit import CheckpointStore

EPOCHS, STEPS_PER_EPOCH = 2, 22  # 1,437 training samples, global batch 64
# script -> (its backend, the launcher of the uninterrupted run, that of the resumed one)
SCRIPTS = {
    "torch_cnn.py": ("horovod-torch", "horovodrun-gloo", "mpirun"),
    "keras_cnn.py": ("horovod-tf", "horovodrun-mpi", "horovodrun-gloo"),
    "flax_cnn.py": ("jax-pjit", "horovodrun-gloo", "srun"),
}
# What the examples may print: the toolkit's lines (its start-up block among them) and nothing
# of any framework's start-up.
# horovodrun tags output "[0]<stdout>:" (Gloo) or "[1,0]<stdout>:" (MPI: also before a line's
# newline when print writes it separately, which can end up at the end of the line).
TAG = re.compile(r"\[[\d,]+\]<stdout>:")
ALLOWED = re.compile(r"(epoch \d+  step \d+  loss \d+\.\d+  val_loss \d+\.\d+  "
                     r"\(\d+\.\d+ s\)|done: world_size 2  steps \d+  val_loss \d+\.\d+  "
                     r"val_accuracy \d\.\d{4}|resumed from \S+ \(step \d+, written by \S+ on 2 "
                     r"ranks\)|(backend|layout|world|placement|batch|model|data|checkpoints|"
                     r"mfu) +\S.*| {12}\S.*)$")  # (the placement table's further lines)


def run(launch, launcher, script, ckpt, epochs, extra=()) -> str:
    """Runs the example on 2 ranks; returns its output lines without horovodrun's tags."""
    job = launch(launcher, 2, [f"examples/bring_your_own/{script}", "--epochs", str(epochs),
                               "--checkpoint-dir", str(ckpt), *extra], timeout=480)
    assert job.returncode == 0, job
    lines = [TAG.sub("", line) for line in job.stdout.splitlines()]
    lines = [line for line in lines if line.strip()]
    assert [line for line in lines if not ALLOWED.fullmatch(line)] == [], job
    assert sum("done: " in line for line in lines) == 1, job
    return "\n".join(lines)


def final_state(ckpt):
    latest = CheckpointStore(ckpt).load("latest")
    assert latest.step == EPOCHS * STEPS_PER_EPOCH
    return latest.tensors


@pytest.mark.slow
@pytest.mark.parametrize("script", [  # (Keras and Flax resumes: also tests/adapters' native
    # optimizer tests; make test-long runs these two)
    s if s == "torch_cnn.py" else pytest.param(s, marks=pytest.mark.long) for s in SCRIPTS])
def test_example_learns_and_resumes_bit_for_bit(script, launch, tmp_path):
    backend, whole, resumed = SCRIPTS[script]
    half = EPOCHS // 2 * STEPS_PER_EPOCH
    out = run(launch, whole, script, tmp_path / "straight", EPOCHS,
              ["--checkpoint-every", str(half)])
    assert len(re.findall(r"epoch \d+  step", out)) == EPOCHS, out
    done = re.search(rf"done: world_size 2  steps {EPOCHS * STEPS_PER_EPOCH}  .* "
                     r"val_accuracy (\S+)", out)
    assert done and float(done.group(1)) > 0.9, out

    # What a job killed after its checkpoint of step `half` leaves behind; then --resume latest.
    name = f"step_{half:09d}"
    shutil.copytree(tmp_path / "straight" / name, tmp_path / "killed" / name)
    again = run(launch, resumed, script, tmp_path / "killed", EPOCHS, ["--resume", "latest"])
    assert re.search(rf"resumed from \S+{name} \(step {half}, written by {backend} on 2 "
                     r"ranks\)", again), again
    assert len(re.findall(r"epoch \d+  step", again)) == EPOCHS - EPOCHS // 2, again
    assert f"done: world_size 2  steps {EPOCHS * STEPS_PER_EPOCH} " in again, again

    want, got = final_state(tmp_path / "straight"), final_state(tmp_path / "killed")
    assert got.keys() == want.keys()
    assert any(k.startswith("buffers/") and ("mean" in k or "var" in k) for k in got), got.keys()
    assert any(k.startswith("opt/") for k in got), got.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


# script -> the layouts beyond data parallelism it runs with the framework's own optimizer, and
# two names of that optimizer's state in the checkpoint (a moment's prefix, the step count)
LAYOUTS = {"torch_cnn.py": (("sharded:3", "pipeline:2:2"), ("opt/mu/", "opt/count")),
           "keras_cnn.py": (("sharded:3", "pipeline:2:2"), ("opt/momentum/", "opt/iteration")),
           "flax_cnn.py": (("sharded:3", "pipeline:2:2"), ("opt/0.mu.", "opt/0.count"))}


@pytest.mark.slow
@pytest.mark.parametrize(("script", "layout"),
                         [(s, layout) for s, (layouts, _) in LAYOUTS.items() for layout in layouts])
def test_example_learns_under_other_layouts(script, layout, launch, tmp_path):
    """The example's own optimizer (its class and settings as the user wrote them) under a
    sharded or pipeline layout on 2 ranks: it learns, and its checkpoint holds the optimizer
    state under the neutral names and the BatchNorm statistics training moved (running means
    start at zero)."""
    out = run(launch, "mpirun", script, tmp_path, 1, ["--layout", layout])
    done = re.search(r"val_accuracy (\S+)", out)
    assert done and float(done.group(1)) > 0.9, out
    state = CheckpointStore(tmp_path).load("latest").tensors
    moment, count = LAYOUTS[script][1]
    assert any(k.startswith(moment) for k in state) and count in state, sorted(state)
    assert any(k.startswith("buffers/") and k.endswith("mean") and np.any(state[k] != 0)
               for k in state), sorted(state)


@pytest.mark.slow
def test_a_hugging_face_gpt2_trains_alike_under_data_parallel_zero3_and_a_pipeline(
        launch, tmp_path, read_metrics):
    """examples/bring_your_own/hf_gpt2.py: a tiny GPT2LMHeadModel (its forward returns a
    ModelOutput; its head tied to its embedding), AdamW with OneCycleLR as the pair, 2 ranks:
    every step's loss under sharded:3 and under pipeline:2:2 (the same modules as an
    nn.Sequential, the tie kept across the two stages) equals data parallel's, the lr the
    scheduler set is logged, and the validation loss is below a uniform byte's ln 256."""
    losses, said = {}, {}
    for layout in ("data", "sharded:3", "pipeline:2:2"):
        log = tmp_path / f"{layout}.jsonl"
        job = launch("any", 2, ["examples/bring_your_own/hf_gpt2.py", "--steps", "8",
                                "--context", "32", "--width", "32", "--batch-size", "8",
                                "--dropout", "0", "--layout", layout,
                                "--metrics-log", str(log)], timeout=300)
        assert job.returncode == 0, job
        assert "Traceback" not in job.stderr and "[transformers]" not in job.stderr, job
        losses[layout] = read_metrics(log)["steps"]
        said[layout] = float(re.search(r"done: .* val_loss (\S+)", job.stdout).group(1))
        records = [json.loads(line) for line in log.read_text().splitlines()]
        lrs = [r["lr"] for r in records if r["event"] == "step"]
        assert len(lrs) == 8 and max(lrs) > 10 * lrs[0], lrs  # OneCycleLR's warm-up
    assert sorted(losses["data"]) == list(range(1, 9))
    for layout in ("sharded:3", "pipeline:2:2"):
        np.testing.assert_allclose([losses[layout][s] for s in range(1, 9)],
                                   [losses["data"][s] for s in range(1, 9)], rtol=1e-6)
        assert said[layout] == pytest.approx(said["data"], rel=1e-5)
    assert said["data"] < np.log(256)
