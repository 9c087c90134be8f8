"""Hand-written faults that the tests must catch, for the backends and the shared core.

Each fault is one exact text edit of one source file (``old`` -> ``new``), applied to a scratch
copy of the code, never to this tree; the tests named for it then run against that copy and
must fail. A fault whose ``old`` text is not found exactly once is an error, so a refactor that
moves the code makes this list fail loudly instead of passing by testing nothing.

    python tools/faults.py                 # every fault (make faults)
    python tools/faults.py --list          # the table of faults, and whether each still applies
    python tools/faults.py --only not-averaged,sampler-epoch-seed:core
    python tools/faults.py --markdown /tmp/faults.md  # the table, as in docs/faults.md
    make faults FAULTS_ARGS="--only jax-pmap"

``--only`` takes fault names (``kind:backend``), kinds (``not-averaged``) or backends
(``horovod-torch``), comma-separated.

How a fault is run:

1. ``toolkit/``, ``adapters/``, ``tests/``, ``examples/``, ``pyproject.toml`` and ``setup.cfg`` of
   the working tree (uncommitted edits included) are copied into a fresh temporary folder.
2. Before the first fault of each distinct test selection, that selection runs once on the
   unmodified copy: it must pass (at least one test passed, none skipped), else the fault's
   result would mean nothing and it is reported as ERROR.
3. The fault's edit is applied to a fresh copy and ``python -m pytest -x -q -p
   no:cacheprovider --basetemp=<copy>/.pytest-tmp <selection>`` runs in it, with
   ``PYTHONPATH`` set to the copy: its modules come before the editable install's, in pytest
   and in every process the tests launch.
4. Result: CAUGHT (pytest exit status 1: a test failed), MISSED (0: every test passed), ERROR
   (anything else: a collection error, a timeout, a red baseline, an edit that does not apply).

Exit status 0 when every fault run was CAUGHT, 1 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COPIED = ("toolkit", "adapters", "tests", "examples", "pyproject.toml", "setup.cfg")
TIMEOUT = 1200  # seconds for one pytest run (the suite's own per-test timeout is 600)

from fault_list import FAULTS, Fault  # noqa: E402  (beside this script)


# ------------------------------------------------------------------------------ mechanics
class FaultError(Exception):
    """A fault that cannot be applied (its ``old`` text is not found exactly once)."""


def check_applies(fault: Fault, root: Path = ROOT) -> str:
    """The fault's file text; a FaultError unless ``old`` occurs in it exactly once."""
    path = root / fault.file
    if not path.is_file():
        raise FaultError(f"{fault.name}: {fault.file} does not exist")
    text = path.read_text()
    count = text.count(fault.old)
    if count != 1:
        raise FaultError(f"{fault.name}: the old text occurs {count} times in {fault.file} "
                         f"(expected once): {fault.old.strip()!r}")
    return text


def scratch_copy() -> Path:
    """A fresh copy of the code and tests of the working tree (no caches, no build output)."""
    folder = Path(tempfile.mkdtemp(prefix="faults-"))
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for name in COPIED:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, folder / name, ignore=ignore)
        elif source.is_file():
            shutil.copy2(source, folder / name)
    return folder


def scratch_env(folder: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(folder), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def check_imports_from(folder: Path) -> None:
    """The copy's modules are the ones imported there (not the editable install's)."""
    probe = subprocess.run(
        [sys.executable, "-c", "import toolkit, adapters; print(toolkit.__file__); "
         "print(adapters.__file__)"],
        cwd=folder, env=scratch_env(folder), capture_output=True, text=True, timeout=120)
    files = probe.stdout.split()
    if probe.returncode or len(files) != 2 or not all(
            Path(f).resolve().is_relative_to(folder.resolve()) for f in files):
        raise FaultError(f"the scratch copy's modules are not the ones imported in {folder}: "
                         f"{probe.stdout}{probe.stderr}")


@dataclasses.dataclass
class Run:
    returncode: int | None  # None: timed out
    seconds: float
    output: str

    @property
    def summary(self) -> str:
        """pytest's last line (``1 failed, 2 passed in 3.4s``)."""
        lines = [ln.strip("= ") for ln in self.output.strip().splitlines() if ln.strip()]
        return lines[-1] if lines else ""

    def count(self, word: str) -> int:
        found = re.search(rf"(\d+) {word}", self.summary)
        return int(found.group(1)) if found else 0


def run_pytest(folder: Path, tests: tuple[str, ...]) -> Run:
    # --basetemp inside the copy: its tmp_path folders go with it (and never meet those of
    # another pytest run on the machine)
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
           f"--basetemp={folder / '.pytest-tmp'}", *tests]
    start = time.monotonic()
    # Its own session: on a timeout or ^C the whole group goes (pytest, the launchers, ranks).
    proc = subprocess.Popen(cmd, cwd=folder, env=scratch_env(folder), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, _ = proc.communicate()
        return Run(None, time.monotonic() - start, out + f"\n(timed out after {TIMEOUT} s)")
    except BaseException:
        _kill_group(proc)
        proc.wait()
        raise
    return Run(proc.returncode, time.monotonic() - start, out)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@dataclasses.dataclass
class Result:
    fault: Fault
    status: str  # CAUGHT, MISSED, ERROR
    seconds: float
    note: str = ""
    output: str = ""


def classify(run: Run) -> tuple[str, str]:
    if run.returncode == 1:
        lines = run.output.splitlines()
        failed = [ln for ln in lines if ln.startswith("FAILED ")][:3]
        errors = [ln for ln in lines if ln.startswith("E  ") and ln[1:].strip()][:2]
        return "CAUGHT", "\n".join([run.summary, *(ln[:200] for ln in failed + errors)])
    if run.returncode == 0:
        return "MISSED", run.summary
    why = "timed out" if run.returncode is None else f"pytest exit status {run.returncode}"
    return "ERROR", f"{why}: {run.summary}"


def baseline(tests: tuple[str, ...]) -> tuple[bool, str, float]:
    """Runs ``tests`` on an unmodified copy: (green, note, seconds)."""
    folder = scratch_copy()
    try:
        check_imports_from(folder)
        run = run_pytest(folder, tests)
    except FaultError as err:
        return False, str(err), 0.0
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    green = run.returncode == 0 and run.count("passed") > 0 and run.count("skipped") == 0
    note = run.summary if green else f"baseline not green: {classify(run)[1]}\n{tail(run.output)}"
    return green, note, run.seconds


def run_fault(fault: Fault) -> Result:
    folder = scratch_copy()
    start = time.monotonic()
    try:
        text = check_applies(fault, folder)
        (folder / fault.file).write_text(text.replace(fault.old, fault.new))
        run = run_pytest(folder, fault.tests)
    except FaultError as err:
        return Result(fault, "ERROR", time.monotonic() - start, str(err))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    status, note = classify(run)
    return Result(fault, status, run.seconds, note, run.output)


def tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


# ------------------------------------------------------------------------------ reporting
def tests_text(fault: Fault) -> str:
    return " ".join(t.replace("tests/", "", 1) if t.startswith("tests/") else t
                    for t in fault.tests)


def table(results: list[Result]) -> str:
    rows = [("fault", "backend", "file", "tests", "result", "seconds")]
    rows += [(r.fault.kind, r.fault.backend, r.fault.file, tests_text(r.fault), r.status,
              f"{r.seconds:.0f}") for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row[:5], widths, strict=True))
                     + "  " + row[5] for row in rows)


def markdown(results: list[Result], total: float, command: str) -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    out = ["| fault | backend | file | the edit | tests | result | seconds |",
           "|---|---|---|---|---|---|---|"]
    for r in results:
        f = r.fault
        out.append(f"| {f.kind} | {f.backend} | `{f.file}` | {cell(f.what)} | "
                   f"`{cell(tests_text(f))}` | {r.status} | {r.seconds:.0f} |")
    counts = {s: sum(r.status == s for r in results) for s in ("CAUGHT", "MISSED", "ERROR")}
    out += ["", f"{len(results)} faults: {counts['CAUGHT']} caught, {counts['MISSED']} missed, "
            f"{counts['ERROR']} errors; {total / 60:.1f} minutes in all, baselines included "
            f"(`{command}`)."]
    return "\n".join(out) + "\n"


def selected(only: str | None) -> list[Fault]:
    if not only:
        return list(FAULTS)
    wanted = [w.strip() for w in only.split(",") if w.strip()]
    known = {f.name for f in FAULTS} | {f.kind for f in FAULTS} | {f.backend for f in FAULTS}
    unknown = [w for w in wanted if w not in known]
    if unknown:
        raise SystemExit(f"faults.py: unknown fault, kind or backend {unknown}; see --list")
    return [f for f in FAULTS if {f.name, f.kind, f.backend} & set(wanted)]


def list_faults(faults: list[Fault]) -> int:
    bad = 0
    for f in faults:
        try:
            check_applies(f)
            state = "applies"
        except FaultError as err:
            state, bad = f"DOES NOT APPLY: {err}", bad + 1
        print(f"{f.name:42} {f.file:36} {state}\n    {f.what}\n    tests: {tests_text(f)}")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    global TIMEOUT
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", metavar="NAME[,NAME]",
                        help="fault names (kind:backend), kinds or backends to run")
    parser.add_argument("--list", action="store_true", help="list the faults and exit")
    parser.add_argument("--timeout", metavar="SECONDS", type=float, default=TIMEOUT,
                        help=f"the most one pytest run may take (default {TIMEOUT})")
    parser.add_argument("--markdown", metavar="PATH", type=Path,
                        help="also write the results as a markdown table to PATH")
    args = parser.parse_args(argv)
    TIMEOUT = args.timeout
    faults = selected(args.only)
    if args.list:
        return list_faults(faults)
    for f in faults:  # every edit must still apply before anything runs
        try:
            check_applies(f)
        except FaultError as err:
            print(f"faults.py: {err}", file=sys.stderr)
            return 1
    start = time.monotonic()
    baselines: dict[tuple[str, ...], tuple[bool, str, float]] = {}
    results: list[Result] = []
    for i, fault in enumerate(faults, 1):
        if fault.tests not in baselines:
            print(f"[baseline] {tests_text(fault)} ...", flush=True)
            baselines[fault.tests] = baseline(fault.tests)
            green, note, seconds = baselines[fault.tests]
            print(f"[baseline] {'green' if green else 'NOT GREEN'} in {seconds:.0f} s: "
                  f"{note}", flush=True)
        green, note, _ = baselines[fault.tests]
        if not green:
            result = Result(fault, "ERROR", 0.0, "the unmodified copy fails these tests")
        else:
            print(f"[{i}/{len(faults)}] {fault.name} ...", flush=True)
            result = run_fault(fault)
        results.append(result)
        print(f"[{i}/{len(faults)}] {fault.name}: {result.status} in {result.seconds:.0f} s: "
              + "\n    ".join(result.note.splitlines()), flush=True)
        if result.status != "CAUGHT" and result.output:
            print(tail(result.output), flush=True)
    total = time.monotonic() - start
    print()
    print(table(results))
    print(f"\n{sum(r.status == 'CAUGHT' for r in results)} of {len(results)} faults caught "
          f"in {total / 60:.1f} minutes (baselines included)")
    if args.markdown:
        command = "make faults" if not args.only else f"python tools/faults.py --only {args.only}"
        args.markdown.write_text(markdown(results, total, command))
        print(f"wrote {args.markdown}")
    return 0 if all(r.status == "CAUGHT" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
