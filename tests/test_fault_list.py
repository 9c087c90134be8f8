"""Every hand-written fault of tools/fault_list.py still applies to the tree, and names tests
that exist: a refactor that moves the code a fault edits fails here, in ``make test``, instead
of retiring the fault silently until someone runs ``make faults``."""

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from fault_list import FAULTS  # noqa: E402
from faults import FaultError, check_applies  # noqa: E402


def _defined(path: Path) -> set[str]:
    return {node.name for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)}


@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
def test_the_fault_applies_and_its_tests_exist(fault):
    check_applies(fault)  # raises FaultError unless the old text occurs exactly once
    assert fault.old != fault.new
    nodes = [t for t in fault.tests if "::" in t or t.endswith(".py")]
    assert nodes, f"{fault.name} names no test file"
    for node in nodes:
        file, *names = node.split("::")
        path = ROOT / file if file.startswith("tests/") else ROOT / "tests" / file
        assert path.is_file(), f"{fault.name}: {file} does not exist"
        if names:
            function = names[-1].split("[")[0]
            assert function in _defined(path), f"{fault.name}: no {function} in {file}"


def test_a_fault_that_no_longer_applies_is_an_error(tmp_path):
    fault = FAULTS[0]
    (tmp_path / fault.file).parent.mkdir(parents=True)
    (tmp_path / fault.file).write_text("# the code moved elsewhere\n")
    with pytest.raises(FaultError, match="occurs 0 times"):
        check_applies(fault, tmp_path)
