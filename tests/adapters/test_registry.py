"""The backend registry: names, errors, and no framework imported before a backend is chosen."""

import subprocess
import sys

import pytest

import adapters
from toolkit import ToolkitError


def test_backend_names():
    assert adapters.BACKENDS == ("horovod-torch", "horovod-tf", "jax-pmap", "jax-pjit")
    assert adapters.IMPLEMENTED == adapters.BACKENDS


def test_unknown_backend_lists_valid_names():
    with pytest.raises(ToolkitError) as err:
        adapters.get("tensorflow")
    assert "unknown backend 'tensorflow'" in str(err.value)
    assert "horovod-torch, horovod-tf, jax-pmap, jax-pjit" in str(err.value)


def test_local_devices_is_for_jax_only():
    with pytest.raises(ToolkitError, match="local_devices=2 applies to the JAX backends only"):
        adapters.get("horovod-torch", local_devices=2)
    with pytest.raises(ToolkitError, match="local_devices=0 must be >= 1"):
        adapters.get("jax-pmap", local_devices=0)


def test_bad_dtype_is_refused():
    with pytest.raises(ToolkitError, match="unknown dtype 'float16'"):
        adapters.get("horovod-torch", dtype="float16")


def test_importing_toolkit_and_adapters_imports_no_framework():
    code = ("import sys, toolkit, adapters, toolkit.datasets, toolkit.equivalence, "
            "adapters.equivalence; "
            "[adapters.get(b) for b in adapters.BACKENDS]; "
            "print(sorted(m for m in ('torch', 'tensorflow', 'jax', 'horovod') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
