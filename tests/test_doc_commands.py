"""Every command the docs give for a figure runs, in a smoke mode: a step or two, exit status 0,
and the line that heads or labels the figure's table printed (its values are not checked).

The commands are read from the docs themselves (``docs/*.md``, ``docs/layouts/*.md``): each
line of a fenced block that runs a command (Python directly or under ``mpirun``, ``horovodrun``
or ``srun``; ``make``, ``sbatch``, ...), and each inline code span that starts with ``python``
and has options (a bare ``python -m toolkit.memory`` names the program, it is no command). A
newly documented command runs here as soon as its program has a rule in :data:`SMOKE` (the
options that make it short, and the figure's lines);
:func:`test_every_documented_command_has_a_rule` fails until it has one or its program is listed
in :data:`NOT_RUN` with the reason.

How a documented command becomes its smoke run:
- ``[--option value]`` (optional) groups are dropped and ``a|b`` alternatives take ``a``;
- the rule's options are set (replacing the documented value, or added);
- comma-separated backends and layouts keep their first, world sizes their smallest (a rule
  names the backend, layout or world sizes to use where the command gives none);
- files and folders a command writes (``--json``, ``--png``, ``TOOLKIT_PIPELINE_TIMELINE``, ...)
  go to the test's temporary folder, shared by the commands of one block, which run in order
  (a block that writes a timeline and then draws it);
- the launcher: ``mpirun`` for a command given with mpirun; ``any`` (mpirun, tests/conftest.py)
  for horovodrun and srun, whose launch is not the subject here (``taskset`` pinning dropped).
A command whose smoke run equals an earlier one (and shares no files) runs once.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([*ROOT.glob("docs/*.md"), *ROOT.glob("docs/layouts/*.md")])
LAUNCHERS = {"mpirun": "-np", "horovodrun": "-np", "srun": "-n"}
# the first word of a documented shell line that is a command (anything else in a fenced
# block is output, a table or a listing)
COMMAND_WORDS = ("python", "python3", "mpirun", "horovodrun", "srun", "make", "sbatch",
                 "scancel", "torchrun")


@dataclass(frozen=True)
class Smoke:
    """How to run a documented program briefly, and the figure's line(s) it must print."""

    figure: tuple[str, ...]  # regular expressions, each matching some line of the output
    options: dict[str, str] = field(default_factory=dict)  # set: replaced, or added
    first_of: dict[str, str] = field(default_factory=dict)  # keep the first value (or this)
    smallest_of: dict[str, str] = field(default_factory=dict)  # keep the smallest (or this)
    outputs: tuple[str, ...] = ()  # options naming a file or folder the command writes
    positional: tuple[str, ...] = ()  # added when the command gives no positional argument
    folders_positional: bool = False  # its positional arguments are folders it reads
    world_sizes: str | None = None  # the option of the world sizes it launches itself


# examples/train_gpt.py's options for a GPT that trains in a blink
TINY_GPT = {"--layers": "1", "--width": "32", "--heads": "2", "--context": "16",
            "--batch-size": "4", "--sample-bytes": "4"}
EQUIVALENCE_TABLE = (r"^backend\s+world\s+launcher\s+layout\s+device\s+final loss",
                     r"^{backend}\s+{world}\s+\w+\s+\S+")
SMOKE: dict[str, Smoke] = {
    "-m adapters.equivalence": Smoke(
        EQUIVALENCE_TABLE, options={"--steps": "2"},
        first_of={"--backends": "jax-pmap", "--layout": "data"},
        smallest_of={"--world-sizes": "1"}, outputs=("--json", "--plot"),
        world_sizes="--world-sizes"),
    "-m toolkit.memory": Smoke((r"^per rank\s+bytes", r"^total\s+[\d,]+ ")),
    "-m toolkit.pipeline_timeline": Smoke(
        (r"^idle fraction: .*formula \(S-1\)/\(M\+S-1\)", r"^timeline: "),
        outputs=("--png",), folders_positional=True),
    "benchmarks/step_overhead.py": Smoke(
        (r"^\S+\s+world \d+\s+MLP 256-1024-1024-10, batch \d+:\s+toolkit .* hand-written",),
        options={"--steps": "2", "--windows": "1"}),
    "benchmarks/gpt_throughput.py": Smoke(
        (r"world \d+ on \S+\s+GPT [\d,]+ params, batch \d+x\d+:\s+toolkit .* tokens/s",),
        options={"--steps": "1", "--windows": "1", "--layers": "1", "--width": "32",
                 "--heads": "2", "--context": "16", "--batch-size": "4"}),
    "benchmarks/checkpoint_throughput.py": Smoke(
        (r"^state: \d+ MB in \d+ float32 arrays", r"toolkit save / np\.save\+fsync",
         r"^training step \(horovod-torch MLP"),
        options={"--mb": "1", "--repeats": "1", "--steps": "2"}),
    "benchmarks/staging.py": Smoke(
        (r"^corpus: \d+ MB of uint16 tokens", r"^staging: first copy [\d.]+ s",
         r"^sequential, [\d,]+ MB\s+[\d.]+ s", r"^random windows, \d+x32x1024\s+[\d.]+ s"),
        options={"--mb": "8", "--passes": "1", "--batches": "10"},
        outputs=("--shared-dir", "--local-dir")),
    "benchmarks/stop_signal_overhead.py": Smoke(
        (r"^\S+\s+world \d+: [\d.]+ ms/step without handlers; checking every 1",),
        options={"--steps": "2", "--repeats": "1"}, positional=("horovod-torch",)),
    "benchmarks/sharded_memory.py": Smoke(
        (r"^backend\s+N layout\s+params\s+grads\s+optimizer\s+total\s+estimator",
         r"^{backend}\s+\d+ sharded:3\s+[\d,]+"),
        options={"--layouts": "sharded:3", "--steps": "1", "--layers": "1", "--width": "32",
                 "--heads": "2", "--context": "16", "--batch": "4"},
        first_of={"--backends": "horovod-torch"}, smallest_of={"--world-sizes": "2"},
        world_sizes="--world-sizes"),
    "benchmarks/pipeline_bubble.py": Smoke(
        (r"^schedule\s+formula\s+measured idle", r"^gpipe\s+0\.\d+", r"^1f1b\s+0\.\d+",
         r"^data parallel: \d+ ms per step"),
        options={"--steps": "2", "--warmup": "1", "--width": "64", "--batch-size": "32",
                 "--micro-batches": "2", "--timeline-dir": "{tmp}/timelines"}),
    "benchmarks/pipeline_zero.py": Smoke(
        (r"^layout\s+params\s+grads\s+optimizer\s+held\s+in-step",
         r"^pipeline:2:2\+sharded:3\s+([\d,]+\s+){5}1\s+1\s+[\d.]+"),
        options={"--layouts": "pipeline:2:2+sharded:3", "--repeats": "1", "--steps": "2",
                 "--layers": "2", "--width": "32", "--heads": "2", "--context": "16",
                 "--batch": "8", "--micro-batches": "2"}),
    "benchmarks/pipeline_host_bytes.py": Smoke(
        (r"^horovod-\w+ pipeline:\S+ \S+: numpy held at most [\d.]+ MB during a step; the "
         r"stage's gradient is [\d.]+ MB \(0\.0\dx\)",),  # (a host update: about 3x)
        options={"--windows": "1"}),
    "benchmarks/update_modes.py": Smoke(
        (r"^layout\s+mode\s+ms/step\s+vs 32", r"^data\s+32, skip\s+[\d.]+\s+[\d.]+",
         r"^data\s+fp16-mixed\s+[\d.]+\s+[\d.]+",
         r"^data\s+skip, host\s+[\d.]+\s+[\d.]+|^data: read on the host"),
        options={"--steps": "1", "--windows": "1", "--layouts": "data", "--layers": "1",
                 "--width": "32", "--heads": "2", "--context": "16", "--batch": "4"}),
    "benchmarks/pipeline_recompute.py": Smoke(
        (r"^recompute\s+kept for backward \(stage 0\)\s+step ms", r"^no\s+[\d,]+\s+[\d.]+",
         r"^recomputing takes [\d.]+x"),
        options={"--steps": "1", "--warmup": "1", "--repeats": "1", "--layers": "2",
                 "--width": "32", "--heads": "2", "--context": "16", "--batch": "8"}),
    "benchmarks/activation_checkpointing.py": Smoke(
        (r"^recompute\s+saved by autograd\s+estimator", r"^yes\s+[\d,]+\s+[\d,]+"),
        options={"--repeats": "1", "--context": "32", "--batch": "2", "--layers": "2"}),
    "benchmarks/tf_zero3_recompute.py": Smoke(
        (r"^activation_checkpointing\s+ms/step", r"^False \(keeps the tape\)\s+[\d.]+",
         r"^recomputing takes [\d.]+x"),
        options={"--steps": "1", "--windows": "1", "--context": "16", "--batch": "2",
                 "--layers": "2", "--width": "32", "--heads": "2"}),
    "benchmarks/jax_collectives.py": Smoke(
        (r"^sharded:3\s+jax-pjit\s+[\d.]+ ms/step\s+jax-pmap .*jax-pjit's collectives: "
         r"\{.*all-reduce", r"^gradient all-reduce of 1 matrix"),
        options={"--steps": "2", "--warmup": "1", "--repeats": "1", "--layouts": "sharded:3"}),
    "examples/train_gpt.py": Smoke(
        (r"^step\s+\d+\s+loss [\d.]+\s+val [\d.]+ nats/byte .* tokens/s",
         r"^done: world_size \d+ "),
        options={**TINY_GPT, "--steps": "2", "--eval-every": "2", "--eval-windows": "4",
                 "--final-eval-windows": "64"},
        first_of={"--backend": "horovod-torch"}, outputs=("--checkpoint-dir", "--metrics-log")),
    "-m toolkit.plot": Smoke((r"^run\s+steps\s+final loss\s+val loss\s+throughput",
                              r"^plot: \S+\.png$"), outputs=("--png",),
                             folders_positional=True),
    # the options after ``--`` go to the script: a tiny GPT, no evaluation
    "-m toolkit.scaling": Smoke(
        (r"^N\s+nodes\s+(samples|tokens)/s\s+speed-up\s+efficiency",
         r"^1\s+1\s+[\d.]+\s+1\.00\s+1\.00\s.*\sok$"),
        options={**TINY_GPT, "--steps": "2", "--warmup": "0", "--eval-every": "100",
                 "--final-eval-windows": "0"},
        first_of={"--backend": "horovod-torch"}, smallest_of={"--world-sizes": "1"},
        outputs=("--png", "--out-dir"), world_sizes="--world-sizes"),
    "examples/train_digits.py": Smoke((r"^done: world_size \d+ ",), options={"--steps": "2"},
                                      first_of={"--backend": "horovod-torch"},
                                      outputs=("--checkpoint-dir", "--metrics-log",
                                               "--tensorboard")),
}

# Programs the docs run that are no figure's command here, and why.
NOT_RUN: dict[str, str] = {
    "make": "make targets install and run the suite or its tools (the suite's own duration)",
    "sbatch": "Slurm job control (tests/test_preemption.py submits real jobs)",
    "scancel": "Slurm job control (tests/test_preemption.py submits real jobs)",
    "tools/faults.py": "runs the suite against edited copies (make faults: minutes)",
    "benchmarks/node_link_bytes.py": "needs the two-node cluster (tests/test_two_nodes.py runs "
                                     "it and checks its figures)",
    "tools/mutation.py": "runs mutmut on the core's unit tests (make mutation: minutes)",
    "-m pytest": "the test runner itself",
    "-m adapters.export": "converts a checkpoint a user names (no figure; tests/adapters)",
    "examples/bring_your_own/torch_cnn.py": "usage, no figure (tests/test_bring_your_own.py)",
    "examples/bring_your_own/keras_cnn.py": "usage, no figure (tests/test_bring_your_own.py)",
    "examples/bring_your_own/flax_cnn.py": "usage, no figure (tests/test_bring_your_own.py)",
}
GPU = "needs a GPU (tests/test_gpu.py, make test-gpu)"
TWO_NODES = "needs the two-node cluster (tests/test_two_nodes.py runs each launcher on it)"
@dataclass
class Command:
    """One documented command line, parsed."""

    doc: str  # where: docs/x.md:LINE
    text: str  # as documented
    env: dict[str, str]
    launcher: str | None  # mpirun, horovodrun, srun or None
    nproc: int
    program: str  # "-m adapters.equivalence", "benchmarks/x.py", "make", ...
    args: list[str]


def _words(text: str) -> list[str]:
    """Shell words without comments, optional ``[...]`` groups, and ``a|b`` -> ``a``."""
    words, depth = [], 0
    for w in shlex.split(text, comments=True):
        if w.startswith("["):
            depth += 1
        if depth == 0:
            words.append(w.split("|")[0] if "|" in w and not w.startswith("-") else w)
        if w.endswith("]"):
            depth = max(0, depth - 1)
    return words


def parse(doc: str, text: str) -> Command | None:
    """A command line, or None when it runs nothing (output, tables, a bare program name)."""
    try:
        words = _words(text)
    except ValueError:  # an unclosed quote: prose or output in a block, not a command
        return None
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    if not words or Path(words[0]).name not in COMMAND_WORDS:
        return None
    launcher, nproc = None, 1
    if Path(words[0]).name in LAUNCHERS:
        launcher = Path(words.pop(0)).name
        while words and words[0].startswith("-"):
            option = words.pop(0)
            if option == LAUNCHERS[launcher]:
                nproc = int(words.pop(0))
            elif option.startswith(LAUNCHERS[launcher] + "="):
                nproc = int(option.split("=", 1)[1])
        if words[:2] == ["sh", "-c"]:  # sh -c 'exec taskset -c $RANK python ...'
            words = _words(words[2]) + words[3:]
        if words[:1] == ["exec"]:
            words.pop(0)
        if words[:2] == ["taskset", "-c"]:
            words = words[3:]
    if not words:
        return None
    first = words.pop(0)
    if Path(first).name.startswith("python"):
        if not words:
            return None
        program = " ".join([words.pop(0), words.pop(0)]) if words[0] == "-m" else words.pop(0)
    else:
        program = first
    return Command(doc, " ".join(text.split()), env, launcher, nproc, program, words)


def documented() -> list[tuple[str, list[Command]]]:
    """(where, commands) for every fenced shell block and every inline command of the docs."""
    found = []
    for path in DOCS:
        name = str(path.relative_to(ROOT))
        lines = path.read_text().splitlines()
        fence, block, joined = None, [], ""
        for number, line in enumerate(lines, 1):
            if line.startswith("```"):
                if fence is None:
                    fence, block = number, []
                else:
                    if block:
                        found.append((f"{name}:{fence}", block))
                    fence = None
                continue
            if fence is not None:
                joined += line.rstrip("\\") + " " if line.rstrip().endswith("\\") else line
                if not line.rstrip().endswith("\\"):
                    command = parse(f"{name}:{number}", joined)
                    joined = ""
                    if command:
                        block.append(command)
        text = "\n".join(lines)
        for match in re.finditer(r"`((?:\.venv/bin/)?python3? [^`]+)`", text):
            command = parse(f"{name}:{text.count(chr(10), 0, match.start()) + 1}",
                            " ".join(match.group(1).split()))
            if command and command.args:  # a bare program name is a reference, not a command
                found.append((command.doc, [command]))
    return found


def not_run(command: Command) -> str | None:
    if "gpu" in command.args and "--device" in command.args:
        return GPU
    if command.launcher == "srun" and re.search(r"\s(-N ?|--nodes[= ])[2-9]", command.text):
        return TWO_NODES
    return NOT_RUN.get(command.program)


# ------------------------------------------------------------------ the smoke form
def _set(args: list[str], option: str, value: str) -> list[str]:
    if option in args:
        i = args.index(option)
        return [*args[:i + 1], value, *args[i + 2:]]
    return [*args, option, value]


def _value(args: list[str], option: str) -> str | None:
    return args[args.index(option) + 1] if option in args else None


def _positionals(args: list[str]) -> list[int]:
    """Indices of the positional arguments (words neither an option nor its value)."""
    found, i = [], 0
    while i < len(args):
        if args[i].startswith("-"):
            i += 1 if "=" in args[i] or i + 1 >= len(args) or args[i + 1].startswith("-") \
                else 2
        else:
            found.append(i)
            i += 1
    return found


@dataclass
class SmokeRun:
    command: Command
    launcher: str  # for the launch fixture
    nproc: int
    argv: list[str]  # "{tmp}" stands for the block's temporary folder
    env: dict[str, str]
    figure: list[str]
    multi_process: bool


def smoke_run(command: Command) -> SmokeRun:
    rule = SMOKE[command.program]
    args = list(command.args)
    for option, value in rule.options.items():
        args = _set(args, option, value)
    for option, default in rule.first_of.items():
        args = _set(args, option, (_value(args, option) or default).split(",")[0])
    for option, default in rule.smallest_of.items():
        sizes = (_value(args, option) or default).split(",")
        args = _set(args, option, str(min(int(s) for s in sizes)))
    for option in rule.outputs:
        if option in args:
            args = _set(args, option, "{tmp}/" + Path(_value(args, option)).name)
    positionals = _positionals(args)
    if rule.folders_positional:
        for i in positionals:
            args[i] = "{tmp}/" + Path(args[i]).name
    if not positionals:
        args = [*rule.positional, *args]
    env = {k: "{tmp}/" + Path(v).name if k == "TOOLKIT_PIPELINE_TIMELINE" else v
           for k, v in command.env.items()}
    program = command.program.split() if command.program.startswith("-m ") else [
        command.program]
    backend = (_value(args, "--backends") or _value(args, "--backend")
               or (args[0] if rule.positional and args else None) or "horovod-torch")
    world = _value(args, rule.world_sizes) if rule.world_sizes else None
    figure = [f.replace("{backend}", re.escape(backend)).replace("{world}", world or r"\d+")
              for f in rule.figure]
    return SmokeRun(command, "mpirun" if command.launcher == "mpirun" else
                    "any" if command.launcher else "python", command.nproc,
                    [*program, *args], env, figure,
                    command.nproc > 1 or bool(world and int(world) > 1))


def _key(run: SmokeRun) -> tuple:
    """What a smoke run does, whatever the order of its options."""
    args, positionals = run.argv, _positionals(run.argv)
    options = sorted(tuple(args[i:i + 2]) if i + 1 < len(args) and i + 1 not in positionals
                     and not args[i + 1].startswith("-") else (args[i],)
                     for i in range(len(args)) if args[i].startswith("-"))
    return (run.launcher, run.nproc, tuple(args[i] for i in positionals), tuple(options),
            tuple(sorted(run.env.items())))


def _files(run: SmokeRun) -> set[str]:
    return set(re.findall(r"\{tmp\}/[^\s/]+", " ".join([*run.argv, *run.env.values()])))


def smoke_tests() -> list[tuple[str, list[SmokeRun]]]:
    """(id, runs): each documented command's smoke run, after the runs of its block that write
    the files it reads. A command whose smoke run equals an earlier one, or that runs as
    another's first step, is not a test of its own."""
    seen, tests = set(), []
    for _, commands in documented():
        runs = [smoke_run(c) for c in commands if not not_run(c) and c.program in SMOKE]
        block, first_steps = [], set()
        for i, run in enumerate(runs):
            before = [r for r in runs[:i] if _files(r) & _files(run)]
            first_steps |= {id(r) for r in before}
            block.append((run.command.doc, [*before, run]))
        tests += [(where, group) for where, group in block if id(group[-1]) not in first_steps]
    unique = []
    for where, group in tests:
        if not _files(group[-1]) and _key(group[-1]) in seen:
            continue
        seen.add(_key(group[-1]))
        unique.append((where, group))
    return unique


TESTS = smoke_tests()


def test_every_documented_command_has_a_rule():
    """A command the docs add is either run here (its program has a smoke rule) or listed,
    with the reason, among those that are not."""
    commands = [c for _, block in documented() for c in block]
    assert len(commands) > 20, "the docs' commands were not found: has their format changed?"
    missing = [f"{c.doc}: {c.text} (program {c.program})" for c in commands
               if c.program not in SMOKE and not not_run(c)]
    assert not missing, ("documented commands without a smoke rule (add one to SMOKE, or the "
                         "program to NOT_RUN with the reason):\n" + "\n".join(missing))


def test_the_figures_commands_are_found():
    """The extraction finds the commands of benchmarks.md's figures table and of the pages
    whose figures they reproduce."""
    programs = {run.command.program for _, runs in TESTS for run in runs}
    assert set(SMOKE) <= programs, f"not found in the docs: {set(SMOKE) - programs}"
    docs = {run.command.doc.split(":")[0] for _, runs in TESTS for run in runs}
    assert {"docs/benchmarks.md", "docs/equivalence.md", "docs/memory.md",
            "docs/layouts/pipeline.md", "docs/layouts/sharded.md"} <= docs


def test_parse_reads_launchers_and_wrappers():
    cmd = parse("x", ".venv/bin/horovodrun -np 2 --gloo sh -c 'exec taskset -c $HOROVOD_RANK "
                     ".venv/bin/python benchmarks/pipeline_bubble.py --backend jax-pjit'")
    assert (cmd.launcher, cmd.nproc, cmd.program, cmd.args) == (
        "horovodrun", 2, "benchmarks/pipeline_bubble.py", ["--backend", "jax-pjit"])
    cmd = parse("x", "TOOLKIT_PIPELINE_TIMELINE=tl srun -n 2 --mpi=pmix .venv/bin/python -m "
                     "adapters.equivalence --optimizer sgd|adamw [--model gpt]  # a comment")
    assert (cmd.env, cmd.launcher, cmd.program, cmd.args) == (
        {"TOOLKIT_PIPELINE_TIMELINE": "tl"}, "srun", "-m adapters.equivalence",
        ["--optimizer", "sgd"])
    assert parse("x", "horovod-torch  2  mpirun  data_parallel  0.43  PASS") is None
    run = smoke_run(parse("x", "python -m adapters.equivalence --backends jax-pjit,jax-pmap "
                               "--world-sizes 4,2 --json eq.json"))
    assert run.argv == ["-m", "adapters.equivalence", "--backends", "jax-pjit", "--world-sizes",
                        "2", "--json", "{tmp}/eq.json", "--steps", "2", "--layout", "data"]
    assert run.multi_process and run.launcher == "python"


# A block of more runs than this (the four backends' runs before their plot) is `long`: make
# test-long runs it; each of its commands has a shorter documented form that make test runs.
LONG_BLOCK = 3


def _marks(runs: list[SmokeRun]) -> list:
    return ([pytest.mark.slow] if any(r.multi_process for r in runs) else []) + (
        [pytest.mark.long] if len(runs) > LONG_BLOCK else [])


@pytest.mark.parametrize("where, runs", [pytest.param(where, runs, id=where, marks=_marks(runs))
                                         for where, runs in TESTS])
def test_documented_command_runs_and_prints_its_figure(where, runs, launch, tmp_path):
    """The command (after any of its block that writes what it reads) exits with status 0
    and prints its figure's lines."""
    for run in runs:
        fill = lambda s: s.replace("{tmp}", str(tmp_path))  # noqa: E731
        job = launch(run.launcher, run.nproc, [fill(a) for a in run.argv],
                     env={k: fill(v) for k, v in run.env.items()}, timeout=300)
        shown = f"{run.command.doc}: {run.command.text}\nsmoke: {' '.join(run.argv)}\n{job!r}"
        assert job.returncode == 0, shown
        for figure in run.figure:
            assert re.search(figure, job.stdout, re.M), f"no line matches {figure!r}\n{shown}"
