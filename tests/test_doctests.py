"""The examples in the docstrings run: each module of toolkit/ and adapters/ that has one is
run through doctest, so an example that no longer says what the code does fails here."""

import doctest
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted(
    ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    for package in ("toolkit", "adapters") for path in (ROOT / package).rglob("*.py")
    if ">>> " in path.read_text())


def test_the_modules_with_examples_are_found():
    assert {"toolkit.precision", "adapters._update", "toolkit.data.sampler"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_the_examples_run(name):
    """(An example marked ``+SKIP`` needs what a test has not: a corpus, a launch.)"""
    module = importlib.import_module(name)
    assert any(t.examples for t in doctest.DocTestFinder().find(module)), f"{name}: no examples"
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, result
