"""toolkit.plot and toolkit.scaling's framework-free parts on small synthetic metrics logs: the
figure's data, drawn pixels in each panel, the errors a user gets."""

from __future__ import annotations

import json

import numpy as np
import pytest

from toolkit import plot, scaling
from toolkit.errors import ToolkitError
from toolkit.metrics_file import read_metrics

START = {"event": "start", "backend": "jax-pjit", "precision": "bf16-mixed", "world_size": 2,
         "nodes": 1, "global_batch": 32, "start_step": 0}


def write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture
def old_log(tmp_path):
    """Today's records: several steps share one write time; validation in epoch records."""
    records = [{**START, "time": 100.0}]
    for step in range(1, 41):  # 10 steps per write, 0.5 s apart: 640 samples/s
        records.append({"event": "step", "step": step, "loss": 3.0 / step ** 0.3,
                        "time": 100.0 + 0.5 * ((step + 9) // 10)})
        if step % 20 == 0:
            records.append({"event": "epoch", "epoch": step // 20 - 1, "step": step,
                            "loss": 1.0, "val_loss": 2.0 / step ** 0.2,
                            "time": 100.0 + 0.5 * step / 10})
    records.append({"event": "prefetch", "batches": 40, "wait_seconds": 0.4,
                    "load_seconds": 1.0})
    return write(tmp_path / "old.jsonl", records)


@pytest.fixture
def new_log(tmp_path):
    """With the interval and eval records: tokens/s given."""
    records = [{**START, "backend": "horovod-torch", "precision": "32", "world_size": 4,
                "time": 50.0}]
    for step in range(1, 31):
        records.append({"event": "step", "step": step, "loss": 2.5 - step / 30, "time":
                        50.0 + step * 0.1})
        if step % 10 == 0:
            records.append({"event": "interval", "step": step, "steps": 10, "time":
                            50.0 + step * 0.1, "samples_per_s": 320.0, "tokens_per_s":
                            320.0 * 64, "step_time_s": 0.1, "input_wait_s": 0.002})
            records.append({"event": "eval", "step": step, "time": 50.0 + step * 0.1,
                            "val_loss": 2.6 - step / 30})
    return write(tmp_path / "new.jsonl", records)


def test_reading_old_and_new_logs(old_log, new_log):
    old, new = read_metrics(old_log), read_metrics(new_log)
    assert old.label == "jax-pjit bf16-mixed x2" and new.label == "horovod-torch 32 x4"
    assert [e[0] for e in old.evals] == [20, 40] and [e[0] for e in new.evals] == [10, 20, 30]
    steps, seconds, rate, unit = old.throughput()  # derived from the write times
    assert unit == "samples/s" and np.allclose(rate, 640.0) and steps[-1] == 40
    assert seconds[-1] == pytest.approx(2.0)
    steps, _, rate, unit = new.throughput()  # the interval records'
    assert unit == "tokens/s" and rate.tolist() == [20480.0] * 3 and steps.tolist() == [10, 20,
                                                                                         30]


def test_the_figure_holds_both_runs_in_both_panels(old_log, new_log, tmp_path):
    png = tmp_path / "curves.png"
    fig = plot.draw([read_metrics(old_log), read_metrics(new_log)], str(png), "time",
                    ["old", "new"])
    loss, rate = fig.axes
    labels = [line.get_label() for line in loss.lines]
    assert {"old train", "old validation", "new train", "new validation"} <= set(labels)
    old_train = loss.lines[labels.index("old train")]
    assert old_train.get_xdata()[-1] == pytest.approx(2.0)  # seconds since the start record
    assert [line.get_label() for line in rate.lines] == ["old", "new"]
    assert rate.get_ylabel() == "samples/s or tokens/s"
    image = plot_pixels(png)
    height, width = image.shape[:2]
    assert (width, height) == (1200, 480)
    for half in (image[:, : width // 2], image[:, width // 2:]):  # lines drawn in each panel
        colored = (half.max(axis=2) - half.min(axis=2)) > 0.3
        assert colored.sum() > 500, "a panel has no coloured lines"


def test_runs_against_steps_get_their_differences_from_the_first_in_an_inset(old_log, new_log,
                                                                            tmp_path):
    """Runs that agree draw on top of each other: an inset draws each later run's smoothed
    loss minus the first's, at the steps both logged (none against wall time)."""
    old, new = read_metrics(old_log), read_metrics(new_log)
    fig = plot.draw([old, new], str(tmp_path / "c.png"), "step", ["old", "new"])
    (inset,) = fig.axes[0].child_axes
    (line,) = [ln for ln in inset.lines if ln.get_label() == "new"]
    common, a, b = np.intersect1d(old.steps, new.steps, return_indices=True)
    assert len(common) > 0 and line.get_xdata().tolist() == common.tolist()
    assert np.allclose(line.get_ydata(), plot.smooth(new.losses)[b] - plot.smooth(old.losses)[a])
    assert "minus old's" in inset.get_title()
    timed = plot.draw([old, new], str(tmp_path / "t.png"), "time", ["old", "new"])
    assert timed.axes[0].child_axes == []


def plot_pixels(png):
    import matplotlib.image

    return matplotlib.image.imread(str(png))[..., :3]


def test_the_command_prints_its_summary_and_errors_name_the_file(old_log, tmp_path, capsys):
    png = tmp_path / "c.png"
    assert plot.main([str(old_log), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "jax-pjit bf16-mixed x2  40" in out and f"plot: {png}" in out
    assert plot.main([str(tmp_path / "missing.jsonl"), "--png", str(png)]) == 2
    err = capsys.readouterr().err
    assert "missing.jsonl' does not exist" in err and "HINT: write one" in err
    empty = write(tmp_path / "empty.jsonl", [{**START, "time": 1.0}])
    assert plot.main([str(empty), "--png", str(png)]) == 2
    assert "empty.jsonl' has no step records" in capsys.readouterr().err
    assert plot.main([str(old_log), "--png", str(png), "--labels", "a,b"]) == 2
    assert "names 2 runs, but 1 logs" in capsys.readouterr().err
    with pytest.raises(ToolkitError, match="line 1 is not JSON"):
        bad = tmp_path / "bad.jsonl"
        bad.write_text("{not json\n" + json.dumps(START) + "\n")
        read_metrics(bad)


def test_scaling_measures_after_the_warmup_and_computes_efficiency(old_log, new_log):
    rate, unit, step_s, wait = scaling.measure(read_metrics(old_log), warmup=10)
    assert (rate, unit, step_s, wait) == (pytest.approx(640.0), "samples/s",
                                          pytest.approx(0.05), pytest.approx(0.01))
    rate, unit, step_s, wait = scaling.measure(read_metrics(new_log), warmup=10)
    assert (rate, unit, step_s, wait) == (20480.0, "tokens/s", 0.1, 0.002)
    with pytest.raises(ToolkitError, match="no timed steps after the 40 warm-up"):
        scaling.measure(read_metrics(old_log), warmup=40)
    points = [scaling.Point(1, 1, throughput=100.0), scaling.Point(2, 1, throughput=180.0),
              scaling.Point(3, 1, status="exit 2: error: batch"),
              scaling.Point(4, 2, throughput=200.0)]
    scaling.fill_ratios(points)
    assert [p.efficiency for p in points] == [1.0, 0.9, None, 0.5]
    assert scaling.boundaries(points) == [4]
    text = scaling.table(points)
    assert text.splitlines()[0].split()[:3] == ["N", "nodes", "samples/s"]
    assert "4  2 *" in text and "exit 2: error: batch" in text and "spans another node" in text


def test_the_step_time_splits_into_compute_and_the_rest():
    """Compute is the one-rank reference's step at the same batch per rank, less its input
    wait; the rest of a size's step (less its own wait) is communication and synchronisation;
    a size without a reference keeps "-"."""
    one = scaling.Point(1, 1, step_s=0.200, input_wait_s=0.010, batch_per_rank=32)
    two = scaling.Point(2, 1, step_s=0.150, input_wait_s=0.005, batch_per_rank=16)
    four = scaling.Point(4, 2, step_s=0.100, input_wait_s=None, batch_per_rank=8)
    ref16 = scaling.Point(1, 1, step_s=0.105, input_wait_s=0.005)
    scaling.study.split_step_time([one, two, four], {32: one, 16: ref16})
    assert (one.compute_s, one.comm_s) == (pytest.approx(0.19), 0.0)
    assert (two.compute_s, two.comm_s) == (pytest.approx(0.1), pytest.approx(0.045))
    assert (four.compute_s, four.comm_s) == (None, None)
    rows = [line.split() for line in scaling.table([one, two, four]).splitlines()]
    assert rows[0][5:9] == ["step", "ms", "compute", "ms"] and "comm+sync" in rows[0]
    assert rows[2][:1] + rows[2][5:9] == ["2", "150.0", "100.0", "45.0", "5.00"]
    assert rows[3][-5:] == ["100.0", "-", "-", "-", "ok"]  # (its nodes: "2 *")


def test_several_backends_are_drawn_on_one_picture(tmp_path):
    import matplotlib.image

    studies = {}
    for name, rates in (("a", (100.0, 190.0)), ("b", (100.0, 120.0))):
        points = [scaling.Point(n, 1, throughput=r, step_s=0.3 / n, input_wait_s=0.002,
                                compute_s=0.25 / n, comm_s=0.03 * (n - 1), backend=name,
                                layout="data")
                  for n, r in zip((1, 2), rates, strict=True)]
        scaling.fill_ratios(points)
        studies[scaling.study.study_label(None, points)] = points
    assert list(studies) == ["a, data", "b, data"]  # (the legend: backend and layout)
    png = tmp_path / "s.png"
    fig = scaling.draw(studies, str(png), "strong", "two backends")
    image = matplotlib.image.imread(str(png))[..., :3]
    blue = (image[..., 2] > 0.6) & (image[..., 0] < 0.3)  # C0
    orange = (image[..., 0] > 0.9) & (image[..., 1] > 0.4) & (image[..., 1] < 0.6) \
        & (image[..., 2] < 0.2)  # C1
    assert blue.sum() > 200 and orange.sum() > 200
    third = image.shape[1] * 2 // 3  # the step-time panel: both studies' bars
    assert blue[:, third:].sum() > 500 and orange[:, third:].sum() > 500
    split = fig.axes[2]
    assert split.get_title() == "where a step's time goes"
    labels = [t.get_text() for t in split.get_legend().get_texts()]
    assert labels == ["compute", "comm+sync", "input wait"]  # (the studies: by colour)
    heights = sorted(round(p.get_height(), 6) for p in split.patches)
    assert heights[-1] == 250.0 and 30.0 in heights  # ms: N=1's compute, N=2's comm+sync


def test_a_step_is_the_intervals_wall_time_per_step_under_asynchronous_dispatch(tmp_path):
    """JAX returns from a step before the device has done it: the median step time of its
    interval records is the dispatch time (0.5 ms here); the study's step time is the
    interval's wall time per step (global batch 32 at 160 samples/s: 0.2 s)."""
    records = [{**START, "time": 0.0}]
    for step in (10, 20, 30):
        records += [{"event": "step", "step": step, "loss": 1.0, "time": step * 0.2},
                    {"event": "interval", "step": step, "steps": 10, "time": step * 0.2,
                     "samples_per_s": 160.0, "step_time_s": 0.0005, "input_wait_s": 0.001}]
    rate, unit, step_s, wait = scaling.measure(read_metrics(write(tmp_path / "j.jsonl",
                                                                  records)), warmup=10)
    assert (rate, unit, step_s, wait) == (160.0, "samples/s", pytest.approx(0.2), 0.001)


def test_srun_fills_nodes_in_a_multi_node_allocation():
    env = {"SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_CPUS_PER_NODE": "4(x2)"}
    per_node = scaling.ranks_per_node(None, env)
    assert [scaling.nodes_for(n, "srun", per_node, env) for n in (1, 4, 5, 8)] == [1, 1, 2, 2]
    assert scaling.nodes_for(8, "mpirun", per_node, env) == 1
    assert scaling.nodes_for(8, "srun", per_node, {}) == 1
    assert scaling.ranks_per_node(2, env) == 2
    assert scaling.launch_command("srun", 5, 2, ["x.py"])[:5] == [
        "srun", "-N", "2", "-n", "5"]


def test_scaling_rejects_bad_options(tmp_path, capsys):
    script = write(tmp_path / "s.py", [])
    for argv, message in [(["--world-sizes", "1,two"], "'1,two' is not a list of integers"),
                          (["--mode", "weak"], "weak scaling needs the batch per rank"),
                          (["--script", "nope.py"], "--script 'nope.py' does not exist"),
                          (["--backend", "jax-pjit,jax-pjit"], "empty or repeated backend")]:
        assert scaling.main(["--script", str(script), *argv]) == 2
        assert message in capsys.readouterr().err
