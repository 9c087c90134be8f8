"""``tools/build_horovod.sh``: the patches it makes to Horovod's source and the build settings it
gives, for the CPU and for NCCL. The compiler is stood in for by a ``python`` that records what
``pip wheel`` would have been given (the real build runs in ``tools/install.sh`` and, with
NCCL, on a GPU machine: docs/gpu.md); the source is a miniature of the sdist's build files."""

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FILES = {  # the lines of Horovod 0.28.1's build files that the script patches
    "CMakeLists.txt": "set(CMAKE_CXX_STANDARD 14)\n",
    "horovod/torch/CMakeLists.txt": "set(CMAKE_CXX_STANDARD 14)\n",
    "horovod/tensorflow/CMakeLists.txt": 'list(APPEND SOURCES "mpi_ops.cc"\n "xla_mpi_ops.cc")\n',
    "horovod/common/ops/cuda/CMakeLists.txt": "set(CMAKE_CUDA_STANDARD 11)\n",
}
STAND_IN = r"""#!/usr/bin/env bash
# "python": -c answers where NCCL's pip package is; -m pip wheel records the build it was given
if [ "$1" = -c ]; then echo "$NCCL_PACKAGE"; exit; fi
out=$(pwd)
"$REAL_PYTHON" - "$out" <<'EOF'
import json, os, sys
src = sys.argv[1]
files = {}
for root, _, names in os.walk(src):
    for n in names:
        if n == "CMakeLists.txt":
            p = os.path.join(root, n)
            files[os.path.relpath(p, src)] = open(p).read()
home = os.environ.get("HOROVOD_NCCL_HOME")
nccl = None
if home:
    nccl = {"header": os.path.exists(os.path.join(home, "include", "nccl.h")),
            "library": os.path.realpath(os.path.join(home, "lib", "libnccl.so"))}
env = {k: v for k, v in os.environ.items() if k.startswith(("HOROVOD_", "CMAKE_", "MAKEFLAGS"))}
json.dump({"env": env, "files": files, "nccl": nccl, "path": os.environ["PATH"]},
          open(os.environ["RECORD"], "w"))
EOF
"""


@pytest.fixture
def stand_ins(tmp_path):
    sdist = tmp_path / "horovod-0.28.1.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        for name, text in FILES.items():
            data = text.encode()
            info = tarfile.TarInfo(f"horovod-0.28.1/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    package = tmp_path / "site" / "nvidia" / "nccl"
    (package / "include").mkdir(parents=True)
    (package / "lib").mkdir()
    (package / "include" / "nccl.h").write_text("#define NCCL_MAJOR 2\n")
    (package / "lib" / "libnccl.so.2").write_text("")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python = bin_dir / "python"
    python.write_text(STAND_IN)
    nvcc = tmp_path / "cuda" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text("#!/bin/sh\n")
    for exe in (python, nvcc):
        exe.chmod(0o755)

    def build(**settings) -> dict:
        record = tmp_path / "record.json"
        env = {**os.environ, "HOROVOD_SDIST": str(sdist), "NCCL_PACKAGE": str(package),
               "REAL_PYTHON": sys.executable,
               "RECORD": str(record), "PATH": f"{nvcc.parent}:{os.environ['PATH']}", **settings}
        job = subprocess.run(["bash", str(ROOT / "tools" / "build_horovod.sh"), str(python),
                              str(tmp_path / "wheels")], env=env, capture_output=True,
                             text=True, timeout=60)
        assert job.returncode == 0, job.stderr
        return json.loads(record.read_text())

    return build, package


def test_the_patches_are_made_for_every_build(stand_ins):
    build, _ = stand_ins
    files = build()["files"]
    assert files["CMakeLists.txt"] == "set(CMAKE_CXX_STANDARD 17)\n"
    assert files["horovod/torch/CMakeLists.txt"] == "set(CMAKE_CXX_STANDARD 17)\n"
    assert "xla_mpi_ops.cc" not in files["horovod/tensorflow/CMakeLists.txt"]
    assert "mpi_ops.cc" in files["horovod/tensorflow/CMakeLists.txt"]
    assert files["horovod/common/ops/cuda/CMakeLists.txt"] == "set(CMAKE_CUDA_STANDARD 17)\n"


def test_the_cpu_build_takes_gloo_with_both_frameworks_and_mpi(stand_ins):
    build, _ = stand_ins
    record = build(BUILD_DEVICE="cpu")
    env = record["env"]
    assert env["HOROVOD_CPU_OPERATIONS"] == "GLOO" and "HOROVOD_GPU_OPERATIONS" not in env
    assert env["HOROVOD_WITH_PYTORCH"] == env["HOROVOD_WITH_TENSORFLOW"] == "1"
    assert env["HOROVOD_WITH_MPI"] == env["HOROVOD_WITH_GLOO"] == "1"
    assert env["CMAKE_POLICY_VERSION_MINIMUM"] == "3.5"
    assert record["nccl"] is None


def test_the_gpu_build_links_nccl_from_its_pip_package(stand_ins):
    build, package = stand_ins
    record = build(BUILD_DEVICE="gpu", CUDA_CC_LIST="9.0;8.0", WITH_TENSORFLOW="0",
                   WITH_MPI="0", MAKEFLAGS="-j3")
    env = record["env"]
    assert env["HOROVOD_GPU_OPERATIONS"] == "NCCL" and env["HOROVOD_NCCL_LINK"] == "SHARED"
    assert env["HOROVOD_BUILD_CUDA_CC_LIST"] == "90,80"
    assert env["HOROVOD_WITHOUT_TENSORFLOW"] == env["HOROVOD_WITHOUT_MPI"] == "1"
    assert "HOROVOD_CPU_OPERATIONS" not in env and env["MAKEFLAGS"] == "-j3"
    # the package ships libnccl.so.2 only: the NCCL home links libnccl.so to it
    assert record["nccl"] == {"header": True,
                              "library": str(package / "lib" / "libnccl.so.2")}
    assert env["HOROVOD_CUDA_HOME"].endswith("cuda")  # nvcc's, found on the PATH
    assert any(p.endswith("cuda/bin") for p in record["path"].split(":")[:2])


def test_a_gpu_build_without_nccl_says_so(stand_ins, tmp_path):
    build, package = stand_ins
    (package / "lib" / "libnccl.so.2").unlink()
    with pytest.raises(AssertionError, match="no nccl.h and libnccl.so under"):
        build(BUILD_DEVICE="gpu")
