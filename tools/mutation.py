"""Mutation testing of the framework-free core, one module at a time (``make mutation``).

For each module this copies ``toolkit/``, ``adapters/``, ``tests/`` and ``setup.cfg`` to a
scratch directory ``build/mutation/<module>/``, narrows the ``[mutmut]`` section of the copied
``setup.cfg`` to that module and to the unit-test files that exercise it (``TESTS`` below),
runs ``mutmut run`` there (the working tree is never modified), and reads the verdict of every
mutant back from mutmut's ``mutants/toolkit/<module>.py.meta``. It prints a markdown table
(mutants, killed, survived, timeout, no tests, kill rate per module), writes the ``mutmut show``
diff of each surviving mutant to ``build/mutation/<module>/survivors.diff``, and with
``--write-doc`` replaces that module's row of the table in ``docs/mutation.md``.

Kill rate = (killed + timeout) / mutants: a mutant that makes the tests hang was detected too.

Exit status: 0 when every surviving mutant is named in ``docs/mutation.md`` (classified as
equivalent, or as needing a test), 1 otherwise (the unclassified ones are printed).

    python tools/mutation.py                       # all modules
    python tools/mutation.py toolkit/data/sampler.py   # one module
    python tools/mutation.py --jobs 2 --write-doc toolkit/parallel/layouts.py
"""

from __future__ import annotations

import argparse
import configparser
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRATCH = ROOT / "build" / "mutation"
DOC = ROOT / "docs" / "mutation.md"
TABLE_START, TABLE_END = "<!-- mutation-table:start -->", "<!-- mutation-table:end -->"

# Each module of the framework-free core, and the fast unit tests that must catch its faults.
TESTS = {
    "toolkit/data/sampler.py": ["tests/toolkit/test_sampler.py"],
    "toolkit/parallel/shards.py": ["tests/toolkit/test_layouts.py", "tests/toolkit/test_shards.py"],
    "toolkit/parallel/pipeline/partition.py": ["tests/toolkit/test_partition.py"],
    "toolkit/parallel/pipeline/schedules.py": ["tests/toolkit/test_pipeline.py",
                              "tests/toolkit/test_pipeline_rounds.py"],
    "toolkit/parallel/pipeline/simulation.py": ["tests/toolkit/test_pipeline.py",
                             "tests/toolkit/test_pipeline_rounds.py"],
    "toolkit/checkpoint/store.py": ["tests/toolkit/test_checkpoint.py",
                                    "tests/toolkit/test_checkpoint_pieces.py",
                                    "tests/toolkit/test_checkpoint_cleanup.py"],
    # The Pipeline spec's splits are checked in test_partition.py. (describe() is checked in
    # test_start_summary.py and resolve_layout() through the Trainer, whose tests start
    # Horovod: seconds per mutant, so left out; their mutants count as "no tests".)
    "toolkit/parallel/layouts.py": ["tests/toolkit/test_layouts.py",
                                    "tests/toolkit/test_partition.py"],
    "toolkit/launch/env.py": ["tests/toolkit/test_env.py"],
    "toolkit/models/reference.py": ["tests/toolkit/test_reference.py"],
}
HEADER = ("| module | tests | mutants | killed | survived | timeout | no tests | kill rate "
          "| time |\n|---|---|---:|---:|---:|---:|---:|---:|---:|")


def status_of(exit_code) -> str:
    from mutmut.stats import status_by_exit_code  # the installed, pinned mutmut's own mapping

    return status_by_exit_code[exit_code]


def prepare(module: str) -> Path:
    work = SCRATCH / Path(module).stem
    if work.exists():
        shutil.rmtree(work)
    ignore = shutil.ignore_patterns("__pycache__", ".pytest_cache", "*.pyc")
    shutil.copytree(ROOT / "toolkit", work / "toolkit", ignore=ignore)
    shutil.copytree(ROOT / "tests", work / "tests", ignore=ignore)
    shutil.copytree(ROOT / "adapters", work / "adapters", ignore=ignore)  # some tests import it
    cfg = configparser.RawConfigParser()
    cfg.read(ROOT / "setup.cfg")
    if not cfg.has_section("mutmut"):
        sys.exit("setup.cfg has no [mutmut] section")
    cfg.set("mutmut", "only_mutate", "\n" + module)
    cfg.set("mutmut", "pytest_add_cli_args_test_selection", "\n" + "\n".join(TESTS[module]))
    with open(work / "setup.cfg", "w") as f:
        cfg.write(f)
    return work


def run_module(module: str, jobs: int, mutmut: Path) -> dict:
    work = prepare(module)
    start = time.monotonic()
    proc = subprocess.run([str(mutmut), "run", "--max-children", str(jobs)], cwd=work,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seconds = time.monotonic() - start
    (work / "mutmut-run.log").write_text(proc.stdout)
    meta = work / "mutants" / (module + ".meta")
    if proc.returncode != 0 or not meta.exists():
        print(proc.stdout[-4000:])
        sys.exit(f"mutmut run failed for {module} (exit {proc.returncode}); "
                 f"log: {work}/mutmut-run.log")
    codes = json.loads(meta.read_text())["exit_code_by_key"]
    statuses = {name: status_of(code) for name, code in codes.items()}
    survivors = sorted(name for name, s in statuses.items() if s == "survived")
    diffs = []
    for name in survivors:
        shown = subprocess.run([str(mutmut), "show", name], cwd=work, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True).stdout
        diffs.append(shown.rstrip() + "\n")
    (work / "survivors.diff").write_text("\n".join(diffs))
    count = {s: sum(1 for v in statuses.values() if v == s)
             for s in ("killed", "survived", "timeout", "no tests")}
    other = len(statuses) - sum(count.values())
    return dict(module=module, mutants=len(statuses), other=other, seconds=seconds,
                survivors=survivors, statuses=statuses, **count)


def row(r: dict) -> str:
    rate = (r["killed"] + r["timeout"]) / r["mutants"] if r["mutants"] else float("nan")
    tests = ", ".join(Path(t).name for t in TESTS[r["module"]])
    return (f"| `{r['module']}` | {tests} | {r['mutants']} | {r['killed']} | {r['survived']} | "
            f"{r['timeout']} | {r['no tests']} | {rate:.1%} | {r['seconds']:.0f} s |")


def write_doc(rows: dict[str, str]) -> None:
    text = DOC.read_text()
    start, end = text.index(TABLE_START), text.index(TABLE_END)
    old = {}
    for line in text[start:end].splitlines():
        m = re.match(r"\| `([^`]+)` \|", line)
        if m:
            old[m.group(1)] = line
    old.update(rows)
    table = "\n".join([HEADER] + [old.get(m, f"| `{m}` | "
                                  f"{', '.join(Path(t).name for t in TESTS[m])} | not run yet "
                                  "| | | | | | |") for m in TESTS])
    DOC.write_text(text[:start] + TABLE_START + "\n" + table + "\n" + text[end:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("modules", nargs="*", help=f"default: all of {', '.join(TESTS)}")
    parser.add_argument("--jobs", type=int, default=1,
                        help="mutants tested in parallel (default 1)")
    parser.add_argument("--write-doc", action="store_true",
                        help=f"replace the rows of the modules run in {DOC.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    modules = args.modules or list(TESTS)
    unknown = [m for m in modules if m not in TESTS]
    if unknown:
        parser.error(f"unknown module(s) {unknown}; choose from {list(TESTS)}")
    mutmut = Path(sys.executable).parent / "mutmut"
    if not mutmut.exists():
        sys.exit(f"{mutmut} not found: pip install -r requirements-mutation.txt")
    results = []
    for module in modules:
        print(f"[mutation] {module} against {' '.join(TESTS[module])} ...", flush=True)
        r = run_module(module, args.jobs, mutmut)
        print(f"[mutation] {module}: {r['mutants']} mutants, {r['killed']} killed, "
              f"{r['survived']} survived, {r['timeout']} timeout, {r['no tests']} no tests, "
              f"{r['other']} other, {r['seconds']:.0f} s", flush=True)
        results.append(r)
    print()
    print(HEADER)
    for r in results:
        print(row(r))
    if args.write_doc:
        write_doc({r["module"]: row(r) for r in results})
    doc = DOC.read_text() if DOC.exists() else ""
    unclassified = [n for r in results for n in r["survivors"] if f"`{n}`" not in doc]
    if unclassified:
        print("\nSurviving mutants not classified in docs/mutation.md "
              "(diffs in build/mutation/<module>/survivors.diff):")
        for name in unclassified:
            print(f"  {name}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
