#!/usr/bin/env bash
# Builds the Horovod wheel the toolkit uses from its source distribution, with the two patches
# today's frameworks need (docs/install.md), into a folder. tools/install.sh calls it (and
# caches the wheel); tools/gpu_checks.sh calls it on a GPU machine with no package registry.
#
#   tools/build_horovod.sh PYTHON OUT_DIR
#
# Environment:
#   HOROVOD_SDIST    the horovod-0.28.1.tar.gz to build (default: downloaded with pip)
#   BUILD_DEVICE     cpu (Gloo operations) or gpu (NCCL; needs nvcc and NCCL's pip package)
#   CUDA_CC_LIST     with gpu: compute capabilities to compile for, e.g. "9.0;8.0"
#   WITH_TENSORFLOW  1 (default) or 0      WITH_MPI  1 (default) or 0 (Gloo only)
#   MAKEFLAGS        default -j<cores>
set -euo pipefail
PY=$(realpath -s "$(command -v "$1")")  # absolute, not resolved: a venv's python stays its own
OUT=$2
HOROVOD_VERSION=0.28.1
die() { printf '[install] ERROR: %s\n' "$*" >&2; exit 1; }

build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
if [ -n "${HOROVOD_SDIST:-}" ]; then
  cp "$HOROVOD_SDIST" "$build/"
else
  "$PY" -m pip download -q --no-deps --no-binary :all: -d "$build" "horovod==$HOROVOD_VERSION"
fi
tar -xzf "$build"/horovod-$HOROVOD_VERSION.tar.gz -C "$build"
src="$build/horovod-$HOROVOD_VERSION"
# (1) PyTorch >= 2.1 needs C++17 (upstream PR 3998, never released).
sed -i 's/CMAKE_CXX_STANDARD 14/CMAKE_CXX_STANDARD 17/' "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
# (2) TF 2.21's wheel ships no XLA headers; the XLA ops are optional (jit_compile only).
sed -i '/xla_mpi_ops.cc/d' "$src/horovod/tensorflow/CMakeLists.txt"
# (3) CUDA 13's headers need C++17 in device code too (Horovod asks nvcc for C++11).
sed -i 's/CMAKE_CUDA_STANDARD 11/CMAKE_CUDA_STANDARD 17/' "$src/horovod/common/ops/cuda/CMakeLists.txt"
grep -q 'CMAKE_CXX_STANDARD 17' "$src/horovod/torch/CMakeLists.txt" || die "Horovod patch (C++17) did not apply"
grep -q 'CMAKE_CUDA_STANDARD 17' "$src/horovod/common/ops/cuda/CMakeLists.txt" || die "Horovod patch (CUDA C++17) did not apply"
! grep -q 'xla_mpi_ops.cc' "$src/horovod/tensorflow/CMakeLists.txt" || die "Horovod patch (XLA ops) did not apply"

opts=(HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MXNET=1)
if [ "${WITH_TENSORFLOW:-1}" = 1 ]; then opts+=(HOROVOD_WITH_TENSORFLOW=1); else opts+=(HOROVOD_WITHOUT_TENSORFLOW=1); fi
if [ "${WITH_MPI:-1}" = 1 ]; then opts+=(HOROVOD_WITH_MPI=1); else opts+=(HOROVOD_WITHOUT_MPI=1); fi
if [ "${BUILD_DEVICE:-cpu}" = gpu ]; then
  # NCCL from its pip package (torch's CUDA build brings it), which ships libnccl.so.2 only:
  # Horovod's CMake looks for include/nccl.h and lib/libnccl.so under one home.
  pkg=$("$PY" -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))' 2>/dev/null \
        || "$PY" -c 'import nvidia; print(nvidia.__path__[0])') \
    || die "NCCL's pip package (nvidia-nccl-cuN) is not installed for $PY
HINT: torch's CUDA wheel brings it; else pip install nvidia-nccl-cuN (N: torch.version.cuda's major), or build with BUILD_DEVICE=cpu"
  header=$(find "$pkg" -name nccl.h | head -n 1)
  library=$(find "$pkg" -name 'libnccl.so*' | head -n 1)
  [ -n "$header" ] && [ -n "$library" ] || die "no nccl.h and libnccl.so under $pkg
HINT: reinstall NCCL's pip package (nvidia-nccl-cuN) for $PY, or build with BUILD_DEVICE=cpu"
  mkdir -p "$build/nccl/lib"
  ln -s "$(dirname "$header")" "$build/nccl/include"
  ln -s "$library" "$build/nccl/lib/libnccl.so"
  ln -s "$library" "$build/nccl/lib/$(basename "$library")" 2>/dev/null || true
  nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
  [ -x "$nvcc" ] || die "no nvcc on the PATH or in /usr/local/cuda/bin: Horovod's NCCL operations need CUDA's compiler
HINT: load the CUDA toolkit (e.g. module load cuda) or put its bin/ on the PATH, or build with BUILD_DEVICE=cpu"
  export PATH="$(dirname "$nvcc"):$PATH"
  opts+=(HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_HOME="$build/nccl" HOROVOD_NCCL_LINK=SHARED
         HOROVOD_CUDA_HOME="$(dirname "$(dirname "$nvcc")")")
  ccs=$(echo "${CUDA_CC_LIST:-}" | tr -d '.' | tr ';' ',')
  [ -z "$ccs" ] || opts+=(HOROVOD_BUILD_CUDA_CC_LIST="$ccs")
else
  opts+=(HOROVOD_CPU_OPERATIONS=GLOO)
fi
mkdir -p "$OUT"
# (CMake 4 refuses the bundled third_party's cmake_minimum_required below 3.5 without this.)
(cd "$src" && env PATH="$(dirname "$PY"):$PATH" CMAKE_POLICY_VERSION_MINIMUM=3.5 "${opts[@]}" \
  MAKEFLAGS="${MAKEFLAGS:--j$(nproc)}" \
  "$PY" -m pip wheel -q --no-build-isolation --no-deps -w "$OUT" . ) \
  || die "Horovod build failed (see the compiler output above).
HINT: it needs g++, cmake 3.x and, with MPI, its headers (libopenmpi-dev); set TOOLKIT_CACHE to a writable folder."
