"""The equivalence command end to end: every backend, several world sizes, real launchers."""

import json

import numpy as np
import pytest

from adapters.equivalence import parse_args
from toolkit import ToolkitError
from toolkit.equivalence import LOSS_TOLERANCE, compare

BACKENDS = ["horovod-torch", "horovod-tf", "jax-pmap", "jax-pjit"]


def run_equivalence(launch, tmp_path, *args):
    out = tmp_path / "eq.json"
    job = launch("python", 1, ["-m", "adapters.equivalence", "--json", str(out), *args],
                 timeout=900)
    return job, (json.loads(out.read_text()) if out.exists() else None)


def check_all_pass(job, report, world_sizes, tolerance):
    assert job.returncode == 0, job
    rows = report["results"]
    assert sorted((r["backend"], r["world_size"]) for r in rows) == sorted(
        (b, w) for b in BACKENDS for w in world_sizes)
    for r in rows:
        assert r["status"] == "pass", r
        assert r["max_rel_loss_dev"] <= tolerance, r
    # Whatever the backend and world size, the per-step losses agree with each other too.
    losses = np.array([r["losses"] for r in rows])
    spread = np.max(np.abs(losses - losses[0]) / np.abs(losses[0]))
    assert spread <= 2 * tolerance, spread
    for backend in BACKENDS:
        assert f"{backend}" in job.stdout and "PASS" in job.stdout


@pytest.mark.slow
def test_float32_every_backend_at_world_sizes_1_and_2_with_plot(launch, tmp_path):
    # Warm-up + cosine schedule, Nesterov momentum and L2 decay: the host-side schedule and
    # every SGD branch in every backend.
    # horovodrun chosen explicitly (the other tests take auto's mpirun, 7 s faster a launch).
    job, report = run_equivalence(launch, tmp_path, "--world-sizes", "1,2", "--steps", "50",
                                  "--optimizer", "sgd-cosine", "--launcher", "horovodrun",
                                  "--plot", str(tmp_path / "curves.png"))
    check_all_pass(job, report, [1, 2], LOSS_TOLERANCE["float32"])
    assert {r["launcher"] for r in report["results"]} == {"python", "horovodrun"}
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_float64_cnn_at_world_size_2(launch, tmp_path):
    # The CNN (convolutions through convolutions) with AdamW; the MLP at 2 ranks runs in
    # float32 above; one process in float64: tests/adapters/test_conformance.py.
    job, report = run_equivalence(launch, tmp_path, "--world-sizes", "2", "--steps", "50",
                                  "--dtype", "float64", "--model", "cnn",
                                  "--optimizer", "adamw")
    check_all_pass(job, report, [2], LOSS_TOLERANCE["float64"])


@pytest.mark.long  # 4 ranks x 4 backends: 2 minutes (the CNN at 2 ranks runs in make test)
@pytest.mark.slow
def test_cnn_with_adam_at_world_size_4(launch, tmp_path):
    job, report = run_equivalence(launch, tmp_path, "--world-sizes", "4", "--steps", "50",
                                  "--model", "cnn", "--optimizer", "adam")
    check_all_pass(job, report, [4], LOSS_TOLERANCE["float32"])


@pytest.mark.slow
def test_missing_framework_is_skipped_never_passed(launch, tmp_path):
    # A real missing package: sitecustomize makes 'import tensorflow' fail in the worker.
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['tensorflow'] = None\n")
    out = tmp_path / "eq.json"
    job = launch("python", 1, ["-m", "adapters.equivalence", "--backends", "horovod-tf",
                               "--world-sizes", "1", "--steps", "5", "--json", str(out)],
                 env={"PYTHONPATH": str(site)})
    assert job.returncode == 0, job
    (row,) = json.loads(out.read_text())["results"]
    assert row["status"] == "skipped" and "TensorFlow" in row["reason"], row
    assert "SKIPPED" in job.stdout and "PASS" not in job.stdout


def test_a_deviating_run_fails():
    ref = [2.0, 1.0]
    ok = {"status": "ok", "losses": [2.0, 1.0 + 5e-6], "params": {"w": np.ones(2)}}
    assert compare(dict(ok), ref, {"w": np.ones(2)}, "float32")["status"] == "pass"
    bad = {**ok, "losses": [2.0, 1.0 + 5e-5]}
    assert compare(dict(bad), ref, {"w": np.ones(2)}, "float32")["status"] == "fail"
    assert compare(dict(ok), ref, {"w": np.ones(2)}, "float64")["status"] == "fail"


@pytest.mark.parametrize("argv, match", [
    (["--backends", "horovod-caffe"], "unknown backend 'horovod-caffe'"),
    (["--world-sizes", "3"], "world size 3 does not divide the global batch 64"),
    (["--world-sizes", "two"], "is not a list of integers"),
    (["--model", "resnet"], "unknown model preset 'resnet'"),
    (["--optimizer", "lion"], "unknown optimizer preset 'lion'"),
])
def test_bad_options_are_clear_errors(argv, match):
    with pytest.raises(ToolkitError, match=match):
        parse_args(argv)


def test_bad_dtype_exits_non_zero(launch):
    job = launch("python", 1, ["-m", "adapters.equivalence", "--dtype", "float16"])
    assert job.returncode == 2 and "invalid choice: 'float16'" in job.stderr


def test_the_toolkits_module_names_the_command_instead_of_running_nothing(launch):
    """``toolkit.equivalence`` is the check's framework-free part; run as a command it fails
    with the one that launches the backends, rather than exit 0 having checked nothing."""
    job = launch("python", 1, ["-m", "toolkit.equivalence", "--steps", "2"])
    assert job.returncode == 2 and "run python -m adapters.equivalence" in job.stderr


@pytest.mark.slow
def test_gpt_every_backend_at_world_size_2(launch, tmp_path):
    # (one process: each backend's GPT against the reference in tests/adapters/test_conformance)
    job, report = run_equivalence(launch, tmp_path, "--world-sizes", "2", "--steps", "15",
                                  "--model", "gpt")
    check_all_pass(job, report, [2], LOSS_TOLERANCE["float32"])
    assert {r["launcher"] for r in report["results"]} == {"mpirun"}  # auto's pick


@pytest.mark.slow
def test_pipeline_schedules_at_two_stages(launch, tmp_path):
    """`--layout pipeline:2:4:gpipe,pipeline:2:4:1f1b`: both schedules in one launch per
    backend, every backend, against the float64 reference."""
    job, report = run_equivalence(launch, tmp_path, "--world-sizes", "2", "--steps", "20",
                                  "--layout", "pipeline:2:4:gpipe,pipeline:2:4:1f1b")
    assert job.returncode == 0, job
    rows = {(r["backend"], r["layout"]): r for r in report["results"]}
    assert sorted(rows) == sorted((b, f"pipeline:2:4:{s}") for b in BACKENDS
                                  for s in ("gpipe", "1f1b"))
    for r in rows.values():
        assert r["status"] == "pass", r
        assert r["max_rel_loss_dev"] <= LOSS_TOLERANCE["float32"], r


# (make test-long: in make test the world-4 clipped pipelines below run S = 2, D = 2 in every
# backend, and test_resume_pipeline places a stage's replicas within a node)
@pytest.mark.long
@pytest.mark.slow
def test_pipeline_with_two_replicas_per_stage(launch, tmp_path):
    """S = 2, D = 2 on 4 ranks, every backend: each stage's gradients averaged over its two
    replicas (Horovod process sets; pjit's data axis; pmap's grouped psum), with a replica's
    stages on neighbouring ranks (the default) and with a stage's replicas there instead."""
    layouts = ["pipeline:2:4:1f1b", "pipeline:2:4:1f1b:within-node=replicas"]
    job, report = run_equivalence(launch, tmp_path, "--world-sizes", "4", "--steps", "20",
                                  "--layout", ",".join(layouts))
    assert job.returncode == 0, job
    rows = {(r["backend"], r["layout"]): r for r in report["results"]}
    assert sorted(rows) == sorted((b, layout) for b in BACKENDS for layout in layouts)
    for r in rows.values():
        assert r["status"] == "pass", r
        assert r["max_rel_loss_dev"] <= LOSS_TOLERANCE["float32"], r


@pytest.mark.slow
def test_inside_a_slurm_allocation_the_runs_launch_with_srun(sbatch, tmp_path):
    """``--launcher auto`` in a batch job: the 2-rank run goes through srun (and passes)."""
    out = tmp_path / "eq.json"
    state, log = sbatch("tests/scripts/equivalence.sbatch", [
        "--backends", "jax-pjit", "--world-sizes", "1,2", "--steps", "3", "--json", str(out)],
        ntasks=2)
    assert state == "COMPLETED", log
    rows = {r["world_size"]: r for r in json.loads(out.read_text())["results"]}
    assert rows[2]["launcher"] == "srun" and rows[2]["status"] == "pass", rows
    assert rows[1]["launcher"] == "srun" and rows[1]["status"] == "pass", rows  # srun -n 1


def check_clipped(job, report, clip, combos, tolerance):
    """Every (backend, world, layout) ran, passed, had a norm per step equal to the
    reference's, and most reference steps clipped."""
    assert job.returncode == 0, job
    ref_norms = np.asarray(report["config"]["reference_grad_norms"])
    assert np.mean(ref_norms > clip) >= 0.5, ref_norms
    assert f"clip_grad_norm {clip:g}: the reference clipped" in job.stdout, job
    rows = report["results"]
    assert sorted((r["backend"], r["world_size"], r["layout"]) for r in rows) == sorted(combos)
    for r in rows:
        assert r["status"] == "pass", r
        assert r["max_rel_norm_dev"] <= tolerance and len(r["grad_norms"]) == len(ref_norms), r


# (make test: data parallel and ZeRO-3, the two ways a norm is taken, over whole gradients and
# over shards; make test-long adds ZeRO-1 in float32)
@pytest.mark.slow
@pytest.mark.parametrize("dtype, optimizer, layouts", [
    pytest.param("float32", "sgd", ["data_parallel", "sharded:1", "sharded:3"],
                 marks=pytest.mark.long), ("float64", "adamw", ["data_parallel", "sharded:3"])])
def test_clipping_every_backend_data_parallel_and_sharded_at_1_and_2(launch, tmp_path, dtype,
                                                                     optimizer, layouts):
    job, report = run_equivalence(launch, tmp_path, "--world-sizes", "1,2", "--steps", "12",
                                  "--dtype", dtype, "--optimizer", optimizer,
                                  "--layout", ",".join(layouts), "--clip-grad-norm", "0.4")
    check_clipped(job, report, 0.4, [(b, w, layout) for b in BACKENDS for w in (1, 2)
                                      for layout in layouts], LOSS_TOLERANCE[dtype])


# (one replica with make test-long; in make test the fp16-mixed pipelines below clip one)
@pytest.mark.slow
@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.long), 4])
def test_clipping_every_backend_in_pipelines_of_one_and_two_replicas(launch, tmp_path, world):
    job, report = run_equivalence(launch, tmp_path, "--world-sizes", str(world), "--steps",
                                  "10", "--dtype", "float64", "--optimizer", "adamw",
                                  "--layout", "pipeline:2:4:1f1b", "--clip-grad-norm", "0.4")
    check_clipped(job, report, 0.4, [(b, world, "pipeline:2:4:1f1b") for b in BACKENDS],
                  LOSS_TOLERANCE["float64"])


def test_a_clip_bound_that_is_not_positive_is_refused():
    for bad in ("0", "-1", "nan"):
        with pytest.raises(ToolkitError, match="clip_grad_norm=.* is not a positive number"):
            parse_args(["--clip-grad-norm", bad])


# (fp16-mixed, and world size 1, with make test-long: in make test both run against the
# rounded reference in every backend's process, tests/adapters/test_mixed_precision.py, and
# fp16 across processes in the pipelines below)
@pytest.mark.parametrize("precision, worlds", [
    ("bf16-mixed", "2"), pytest.param("fp16-mixed", "1,2", marks=pytest.mark.long)])
def test_mixed_precision_equals_its_rounded_reference_across_processes(launch, tmp_path,
                                                                       precision, worlds):
    """``--precision bf16-mixed|fp16-mixed``: every backend passes against the reference that
    rounds as it does (the first steps within 1e-6, or 1.5e-6 in float16), never a skip."""
    job, report = run_equivalence(launch, tmp_path, "--precision", precision,
                                  "--world-sizes", worlds, "--steps", "20",
                                  "--layout", "data,sharded:1")
    assert job.returncode == 0, job
    assert f"{precision[:4]} arithmetic rounded as the runs round" in job.stdout
    for r in report["results"]:
        assert r["status"] == "pass" and r["early_rel_loss_dev"] <= 1.5e-6, r
        assert r["data_split"] == [1 if r["backend"] == "jax-pjit" else r["world_size"], 1], r
    assert {r["backend"] for r in report["results"]} == {
        "horovod-torch", "horovod-tf", "jax-pmap", "jax-pjit"}


@pytest.mark.slow
@pytest.mark.parametrize("precision, clip, worlds", [
    pytest.param("bf16-mixed", None, "2,4", marks=pytest.mark.long),
    ("fp16-mixed", "0.5", "2")])
def test_mixed_precision_in_pipelines_equals_its_rounded_reference(launch, tmp_path, precision,
                                                                   clip, worlds):
    """The pipelines in mixed precision, 2 stages x 4 micro-batches on 2 (and 4) ranks: each
    micro-batch's gradient rounded apart (``data_split`` (replicas, 4)), so the reference splits
    the batch so, each part's loss weighted as the run weights it (``part_weight``: float16
    overflows where the run's does); fp16 with clipping (the gradients unscaled before their
    norm)."""
    args = ["--precision", precision, "--world-sizes", worlds, "--steps", "20",
            "--layout", "pipeline:2:4:1f1b"] + (["--clip-grad-norm", clip] if clip else [])
    job, report = run_equivalence(launch, tmp_path, *args)
    assert job.returncode == 0, job
    assert {r["backend"] for r in report["results"]} == {
        "horovod-torch", "horovod-tf", "jax-pmap", "jax-pjit"}
    for r in report["results"]:
        assert r["status"] == "pass" and r["early_rel_loss_dev"] <= 1.5e-6, r
        assert r["data_split"] == [r["world_size"] // 2, 4], r
        # (the Horovod executors divide a micro-batch's loss by M; JAX weights it by its share)
        replicas = 1 if r["backend"].startswith("horovod") else r["world_size"] // 2
        assert r["part_weight"] == 1 / (4 * replicas), r
