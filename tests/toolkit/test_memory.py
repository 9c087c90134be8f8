"""The per-rank memory arithmetic against published figures and real parameter dicts."""

from __future__ import annotations

import numpy as np
import pytest

from toolkit import memory
from toolkit.errors import ToolkitError
from toolkit.models.gpt import GPT
from toolkit.models.specs import MLP
from toolkit.parallel.layouts import DataParallel, Pipeline, Sharded, parse_layout

GB, GIB = 1e9, 2**30


def _rows(out: str) -> dict[str, int]:
    """The table's exact byte counts by row name."""
    rows = {}
    for line in out.splitlines():
        name, _, rest = line.partition("  ")
        if rest.strip() and rest.split()[0].replace(",", "").isdigit():
            rows[name.strip()] = int(rest.split()[0].replace(",", ""))
    return rows


def test_zero_paper_figures_7_5b_on_64_ranks():
    """ZeRO (Rajbhandari et al.), mixed-precision Adam, K = 12: 120 / 31.4 / 16.6 / 1.9 GB."""
    published = {DataParallel(): 120, Sharded(1): 31.4, Sharded(2): 16.6, Sharded(3): 1.9}
    for layout, gb in published.items():
        est = memory.estimate(7_500_000_000, layout, 64, "mixed", "adam")
        assert round(est.model_states / GB, 1) == pytest.approx(gb), layout
    assert memory.bytes_per_param("mixed", "adam") == (2, 2, 12)


def test_course_gpt2_xl_figures():
    """C-DAC course: 1.5B parameters, fp32, Adam: 6 GB parameters, 6 GB gradients, 18 GB Adam
    states, about 56 GB activations at batch 32 x 1024 (the ZeRO paper's "about 60 GB")."""
    acts = memory.gpt_activation_bytes(layers=48, width=1600, context=1024, batch=32,
                                       heads=25, dtype="float32", model="rough")
    est = memory.estimate(1_500_000_000, DataParallel(), 1, "float32", "adam-master", acts)
    assert (est.params / GB, est.grads / GB, est.optimizer / GB) == (6, 6, 18)
    assert round(acts / GIB) == 56
    assert round(acts / GB) == 60
    # torch.optim.Adam itself keeps only the two moments
    assert memory.estimate(1_500_000_000, DataParallel(), 1).optimizer / GB == 12


@pytest.mark.parametrize("spec", [GPT(vocab=50, context=16, width=32, layers=3, heads=4),
                                  GPT(vocab=7, context=5, width=12, layers=1, heads=3,
                                      tied=False)])
def test_parameter_bytes_match_a_real_gpt(spec):
    params = spec.init(0)
    counted = sum(a.nbytes for a in params.values())
    assert memory.estimate(spec.num_params, DataParallel(), 1).params == counted
    assert memory.estimate(spec.num_params, Sharded(3), 4).params == counted / 4


def test_cli_counts_a_gpt_exactly(capsys):
    spec = GPT(vocab=50, context=16, width=32, layers=3, heads=4)
    counted = sum(a.nbytes for a in spec.init(0).values())
    assert memory.main(["--model", "gpt", "--layers", "3", "--width", "32", "--context", "16",
                        "--vocab", "50", "--heads", "4", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert rows["parameters"] == rows["gradients"] == counted
    assert rows["optimizer state"] == 2 * counted
    for word in ("gradients", "optimizer state", "activations", "total", "GB = 1e9 bytes"):
        assert word in out
    acts = 3 * 2 * 16 * (16 * 32 + 4 * 16) * 4
    assert rows["activations"] == acts
    assert rows["total"] == 4 * counted + acts


def test_cli_reproduces_the_zero_stage_3_figure(capsys):
    memory.main(["--params", "7.5e9", "--dtype", "mixed", "--layout", "sharded:3",
                 "--world-size", "64"])
    out = capsys.readouterr().out
    assert "sharded:3 on 64 ranks" in out
    assert "total" in out and "1.88 GB" in out


def test_cli_mlp(capsys):
    memory.main(["--model", "mlp", "--sizes", "64,128,10", "--batch", "4"])
    out = capsys.readouterr().out
    counted = sum(a.nbytes for a in MLP((64, 128, 10)).init(0).values())
    rows = _rows(out)
    assert rows["parameters"] == counted
    assert rows["activations"] == 4 * (64 + 2 * 128 + 10) * 4


def test_cli_cnn_counts_the_spec_arrays(capsys):
    from toolkit.models.specs import CNN

    memory.main(["--model", "cnn", "--channels", "8,16", "--batch", "2", "--layout", "sharded:1",
                 "--world-size", "2"])
    rows = _rows(capsys.readouterr().out)
    spec = CNN(image_shape=(8, 8, 1), channels=(8, 16), classes=10)
    params = sum(a.size for a in spec.init(0).values())  # 3*3*1*8+8 + 3*3*8*16+16 + 1024*10+10
    assert params == 80 + 1168 + 10250
    assert rows["parameters"] == 4 * params
    assert rows["optimizer state"] == 4 * params  # adam's 8 bytes per parameter over 2 ranks
    # activations: 2 images x (8*8*(1 + 2*(8+16)) + 10) elements x 4 bytes
    assert rows["activations"] == 2 * (64 * 49 + 10) * 4


def test_stages_divide_what_they_shard():
    p = 1000
    dp = memory.estimate(p, DataParallel(), 4, activations=100)
    s1, s2, s3 = (memory.estimate(p, Sharded(k), 4, activations=100) for k in (1, 2, 3))
    assert (dp.params, dp.grads, dp.optimizer) == (4000, 4000, 8000)
    assert (s1.params, s1.grads, s1.optimizer) == (4000, 4000, 2000)
    assert (s2.params, s2.grads, s2.optimizer) == (4000, 1000, 2000)
    assert (s3.params, s3.grads, s3.optimizer) == (1000, 1000, 2000)
    assert {e.activations for e in (dp, s1, s2, s3)} == {100}
    tp = memory.estimate(p, Sharded(3, tensor_parallel=2), 4)
    assert tp.params == 4000 / 2 / 2
    assert memory.bytes_per_param("float32", "sgd") == (4, 4, 0)
    assert memory.bytes_per_param("float32", "momentum") == (4, 4, 4)
    assert memory.bytes_per_param("bfloat16", "adam") == (2, 2, 4)
    assert memory.bytes_per_param("mixed", "sgd") == (2, 2, 4)


def test_pipeline_in_flight_activations():
    gpipe = memory.estimate(800, Pipeline(4, 8, "gpipe"), 8, activations=400)
    one_f = memory.estimate(800, Pipeline(4, 8), 8, activations=400)
    few = memory.estimate(800, Pipeline(4, 2), 4, activations=400)
    assert gpipe.params == 800 * 4 / 4
    assert gpipe.activations == 100 * 8
    assert one_f.activations == 100 * 4
    assert few.activations == 100 * 2


@pytest.mark.parametrize("argv, word", [
    (["--params", "1e6", "--layout", "tensor"], "unknown layout 'tensor'"),
    (["--params", "1e6", "--layout", "sharded:4"], "stage=4"),
    (["--params", "1e6", "--world-size", "0"], "world size 0"),
    (["--params", "1e6", "--layout", "pipeline:3:4", "--world-size", "4"], "multiple of the 3"),
    (["--params", "1e6", "--dtype", "float8"], "unknown dtype 'float8'"),
    (["--params", "1e6", "--optimizer", "lion"], "unknown optimizer 'lion'"),
    (["--params", "1e6", "--layers", "2", "--width", "8", "--context", "4",
      "--activations", "exact"], "unknown activation model 'exact'"),
    (["--model", "gpt", "--layers", "2"], "needs --layers, --width and --context"),
    (["--model", "mlp", "--sizes", "a,b"], "not a list of integers"),
    ([], "no model given"),
])
def test_cli_bad_input_is_a_clear_error(argv, word):
    with pytest.raises(ToolkitError) as err:
        memory.main(argv)
    assert word in str(err.value)
    assert "HINT" in str(err.value)


def test_module_runs_and_exits_2_on_bad_input():
    import subprocess
    import sys

    ok = subprocess.run([sys.executable, "-m", "toolkit.memory", "--params", "1e6", "--layers",
                         "4", "--width", "64", "--context", "32", "--batch", "2", "--layout",
                         "pipeline:2:4:gpipe", "--world-size", "4"],
                        capture_output=True, text=True, check=False)
    assert ok.returncode == 0, ok.stderr
    rows = _rows(ok.stdout)
    assert rows["parameters"] == 2_000_000
    assert rows["activations"] == 4 * 2 * 32 * (16 * 64 + 1 * 32) * 4 // 2 * 4
    bad = subprocess.run([sys.executable, "-m", "toolkit.memory", "--params", "1e6",
                          "--world-size", "0"], capture_output=True, text=True, check=False)
    assert bad.returncode == 2
    assert bad.stderr.startswith("error: world size 0") and "HINT" in bad.stderr


@pytest.mark.parametrize("spec, batch", [
    (GPT(vocab=50, context=16, width=32, layers=3, heads=4), 2),
    (GPT(vocab=7, context=5, width=12, layers=1, heads=3, tied=False), 3),
])
def test_gpt_activation_bytes_are_what_the_numpy_forward_keeps(spec, batch):
    """The ``full`` count against the arrays the reference GPT's forward hands its backward,
    counted one by one. That backward also keeps GELU's tanh (4d per token: the published
    count recomputes it from the GELU input) and LayerNorm's 1/std (one number per row: not
    in the published count); both are taken out by name."""
    params = spec.init(0, "float32")
    x = np.random.default_rng(0).integers(0, spec.vocab, (batch, spec.context))
    _, (blocks, _, _) = spec._forward(params, x)  # per-block caches; embeddings, final norm out
    kept = 0
    # (unpacking all twelve entries: an array added to the cache fails here until counted)
    for a, (normed1, _rstd1), q, k, v, probs, o, m, (normed2, _rstd2), z, _tanh, g in blocks:
        arrays = (a, normed1, q, k, v, probs, o, m, normed2, z, g)
        assert {t.dtype for t in arrays} == {np.dtype(np.float32)}  # 4 bytes an element
        kept += sum(t.nbytes for t in arrays)
    assert memory.gpt_activation_bytes(spec.layers, spec.width, spec.context, batch,
                                       spec.heads) == kept


@pytest.mark.parametrize("sizes", [(64, 128, 10), (5, 7, 3, 2)])
def test_mlp_activation_bytes_are_what_the_numpy_forward_keeps(sizes):
    """Every distinct array the reference MLP's forward keeps for its backward (the input, each
    hidden layer's pre-activation and activation, the output), counted one by one."""
    spec, batch = MLP(sizes), 4
    hs, zs = spec._forward(spec.init(0, "float32"), np.ones((batch, sizes[0]), np.float32))
    kept = {id(t): t for t in (*hs, *zs)}  # the output is both the last h and the last z
    assert memory.mlp_activation_bytes(sizes, batch) == sum(t.nbytes for t in kept.values())


@pytest.mark.parametrize("world_size, said", [(1, "on 1 rank;"), (2, "on 2 ranks;")])
def test_cli_says_rank_or_ranks_as_the_count_needs(capsys, world_size, said):
    memory.main(["--params", "1e6", "--world-size", str(world_size)])
    out = capsys.readouterr().out
    assert said in out
    assert "1 ranks" not in out


def test_activation_checkpointing_keeps_each_block_input_and_one_block():
    from toolkit.memory import gpt_activation_bytes

    full = gpt_activation_bytes(48, 1600, 1024, 32, 25)
    kept = gpt_activation_bytes(48, 1600, 1024, 32, 25, recompute=True)
    one_block = full // 48
    assert kept == 48 * 32 * 1024 * 1600 * 4 + one_block  # inputs (float32) + one block
    assert kept < full / 5


def test_a_pipelines_zero_stage_shards_its_stage_and_holds_it_whole_while_a_step_runs(capsys):
    """Pipeline 2 x ZeRO over 4 ranks: each stage's half of the state over its 2 replicas;
    gathering once per step holds the stage's whole parameters (ZeRO-3) and gradient sum
    (ZeRO-2, 3) while the step runs, what benchmarks/pipeline_zero.py measures."""
    p = 1000  # float32, Adam: a stage's 500 parameters are 2000 bytes, its slots 4000
    est = {z: memory.estimate(p, parse_layout(f"pipeline:2:4+sharded:{z}"), 4)
           for z in (1, 2, 3)}
    assert [(e.params, e.grads, e.optimizer) for e in est.values()] == [
        (2000, 2000, 2000), (2000, 1000, 2000), (1000, 1000, 2000)]
    assert [e.gathered for e in est.values()] == [0, 2000, 4000]
    apart = memory.estimate(p, parse_layout("pipeline:2:4+sharded:3:gather=micro-batch"), 4)
    assert (apart.model_states, apart.gathered) == (est[3].model_states, 0)
    memory.main(["--params", "1000", "--layout", "pipeline:2:4+sharded:3", "--world-size", "4"])
    rows = _rows(capsys.readouterr().out)
    assert rows["gathered in step"] == 4000 and rows["peak in a step"] == 4000 + 4000
    memory.main(["--params", "1000", "--layout", "sharded:3", "--world-size", "4"])
    assert "gathered in step" not in capsys.readouterr().out
