"""The code stays lint-clean (ruff, configured in pyproject.toml), and its layers'
imports go one way (the toolkit below the adapters, no import circle)."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    ruff = Path(sys.executable).parent / "ruff"
    proc = subprocess.run([str(ruff), "check", "toolkit", "adapters", "examples", "tests",
                           "benchmarks"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ------------------------------------------------------------------ the layers' imports
PACKAGES = ("toolkit", "adapters")


def _modules() -> dict[str, Path]:
    """Every module of the toolkit and the adapters by dotted name (a package by its own)."""
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(path: Path) -> list[tuple[str, bool]]:
    """``(imported name, inside a function)`` for every import of a source file; ``from m
    import x`` gives ``m.x`` (a module where ``x`` is one, else a name of ``m``)."""
    tree = ast.parse(path.read_text())
    nested = {id(node) for fn in ast.walk(tree)
              if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
              for node in ast.walk(fn) if isinstance(node, ast.Import | ast.ImportFrom)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, id(node) in nested) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out += [(f"{node.module}.{alias.name}", id(node) in nested) for alias in node.names]
    return out


def _import_graph() -> dict[str, dict[str, bool]]:
    """Module -> {module it imports: whether only inside functions}, within the two packages."""
    modules = _modules()
    graph: dict[str, dict[str, bool]] = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, {})
        for imported, nested in _imports(path):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                edges[imported] = edges.get(imported, True) and nested
    return graph


def test_the_toolkit_never_imports_the_adapters():
    """The core sits below the backends: not even a function of it imports ``adapters`` (a
    command that runs backends lives in ``adapters/``, as ``adapters/equivalence.py``)."""
    upward = [f"{path.relative_to(ROOT)} imports {name}"
              for path in (ROOT / "toolkit").rglob("*.py") for name, _ in _imports(path)
              if name == "adapters" or name.startswith("adapters.")]
    assert not upward, upward


def test_no_import_cycle_hides_in_a_function():
    """No module reaches itself through the imports of the two packages, counting the imports
    inside functions: a circle broken by a function-level import is still a circle (the piece
    both sides need belongs in a module below both). A module importing its own package
    (``toolkit.scaling.cli`` reading ``toolkit.scaling``'s docstring) is left out: the package
    is Python's layout, not a module of its own."""
    graph = {a: {b: nested for b, nested in edges.items() if not a.startswith(b + ".")}
             for a, edges in _import_graph().items()}

    def reachable(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    circles = sorted(f"{a} -> {b} ({'in a function' if nested else 'at import'}) -> ... -> {a}"
                     for a, edges in graph.items() for b, nested in edges.items()
                     if a in reachable(b))
    assert not circles, "\n".join(circles)


def test_each_model_module_and_its_neighbour_import_one_way():
    """The spec builders build on the GPT's module (and the GPT on GPT-2's files), a Keras
    model names its optimizer's slots, the optax checks cut flat units: each pair imports one
    way, and what both sides need (layers, option values, the optimizer's kind) sits below
    both."""
    graph = _import_graph()
    pairs = [("toolkit.models.specs", "toolkit.models.gpt"),
             ("toolkit.models.gpt", "toolkit.models.gpt2_files"),
             ("adapters.horovod_torch.models.spec", "adapters.horovod_torch.models.gpt"),
             ("adapters.horovod_tf.models.spec", "adapters.horovod_tf.models.gpt"),
             ("adapters._jax.models.spec", "adapters._jax.models.gpt"),
             ("adapters.horovod_tf.models.keras_native", "adapters.horovod_tf.keras_optim"),
             ("adapters._jax.native_optax", "adapters._jax.flat_units")]
    for upper, lower in pairs:
        assert lower in graph[upper], f"{upper} no longer imports {lower}: update this list"
        assert upper not in graph[lower], f"{lower} imports {upper}"
