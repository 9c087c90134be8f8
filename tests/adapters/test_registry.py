"""The backend registry: names, errors, and no framework imported before a backend is chosen."""

import subprocess
import sys

import pytest

import adapters
from toolkit import ToolkitError


def test_backend_names():
    assert adapters.BACKENDS == ("horovod-torch", "horovod-tf", "jax-pmap", "jax-pjit")
    assert "horovod-torch" in adapters.IMPLEMENTED


def test_unknown_backend_lists_valid_names():
    with pytest.raises(ToolkitError) as err:
        adapters.get("tensorflow")
    assert "unknown backend 'tensorflow'" in str(err.value)
    assert "horovod-torch, horovod-tf, jax-pmap, jax-pjit" in str(err.value)


@pytest.mark.parametrize("name", sorted(set(adapters.BACKENDS) - set(adapters.IMPLEMENTED)))
def test_reserved_backends_say_not_implemented(name):
    with pytest.raises(ToolkitError, match=f"backend '{name}' is not implemented yet"):
        adapters.get(name)


def test_bad_dtype_is_refused():
    with pytest.raises(ToolkitError, match="unknown dtype 'float16'"):
        adapters.get("horovod-torch", dtype="float16")


def test_importing_toolkit_and_adapters_imports_no_framework():
    code = ("import sys, toolkit, adapters, toolkit.datasets; adapters.get('horovod-torch'); "
            "print(sorted(m for m in ('torch', 'tensorflow', 'jax', 'horovod') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
