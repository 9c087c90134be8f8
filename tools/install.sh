#!/usr/bin/env bash
# Installs everything the toolkit needs, idempotently: re-running it is safe and fast.
#
#   tools/install.sh            system MPI (apt, when missing), the venv, Horovod
#   tools/install.sh --slurm    also the Slurm daemons and munge the tests start locally
#
# Environment knobs:
#   TOOLKIT_VENV   where the virtual environment goes        (default: ./.venv)
#   TOOLKIT_CACHE  where the built Horovod wheel is cached    (default: ~/.cache/hpc-toolkit)
#   TOOLKIT_NO_APT=1  never call apt-get (clusters where MPI/Slurm come from modules)
#   PYTHON         the interpreter the venv is made from      (default: python3)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=$(realpath -m "${TOOLKIT_VENV:-$ROOT/.venv}")  # absolute: later steps change directory
CACHE=${TOOLKIT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hpc-toolkit}
PYTHON=${PYTHON:-python3}
HOROVOD_VERSION=0.28.1
WITH_SLURM=0
for arg in "$@"; do
  case "$arg" in
    --slurm) WITH_SLURM=1 ;;
    *) echo "install.sh: unknown option '$arg' (valid: --slurm)" >&2; exit 2 ;;
  esac
done

log() { printf '[install] %s\n' "$*" >&2; }
die() { printf '[install] ERROR: %s\n' "$*" >&2; exit 1; }

# --- 1. System packages -------------------------------------------------------------------
missing=()
command -v mpirun >/dev/null 2>&1 || missing+=(openmpi-bin)
[ -e /usr/include/x86_64-linux-gnu/mpi/mpi.h ] || [ -n "$(command -v mpicxx 2>/dev/null)" ] \
  || missing+=(libopenmpi-dev)
if [ "$WITH_SLURM" = 1 ]; then
  command -v slurmctld >/dev/null 2>&1 || missing+=(slurmctld)
  command -v slurmd >/dev/null 2>&1 || missing+=(slurmd)
  command -v srun >/dev/null 2>&1 || missing+=(slurm-client)
  command -v munged >/dev/null 2>&1 || missing+=(munge)
fi
command -v cmake >/dev/null 2>&1 || missing+=(cmake)
command -v g++ >/dev/null 2>&1 || missing+=(g++)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "${TOOLKIT_NO_APT:-0}" = 1 ] || ! command -v apt-get >/dev/null 2>&1 || [ "$(id -u)" != 0 ]; then
    die "missing system packages: ${missing[*]}.
HINT: on a cluster, load them as modules (e.g. 'module load openmpi cmake') so that mpirun,
      mpicxx and cmake are on PATH, then re-run with TOOLKIT_NO_APT=1; on Debian/Ubuntu as root,
      unset TOOLKIT_NO_APT and this script installs them."
  fi
  log "apt-get install ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  apt-get install -y -q "${missing[@]}" >/dev/null
fi

# --- 2. Virtual environment with the pinned versions ----------------------------------------
stamp="$VENV/.toolkit-requirements.sha256"
want=$(cat "$ROOT/requirements.txt" "$ROOT/constraints.txt" | sha256sum | cut -d' ' -f1)
if [ ! -x "$VENV/bin/python" ]; then
  log "creating virtual environment $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  log "installing pinned Python packages (first time: several minutes, ~3 GB)"
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q -c "$ROOT/constraints.txt" -r "$ROOT/requirements.txt"
  echo "$want" > "$stamp"
fi

# --- 3. Horovod, built once from the sdist and cached as a wheel keyed by versions ----------
# Versions come from package metadata (no framework import), so a re-run takes seconds.
versions=$("$PY" - <<'EOF'
import sys
from importlib.metadata import version
torch = version("torch").split("+")[0]
print(f"py{sys.version_info[0]}{sys.version_info[1]}-torch{torch}-tf{version('tensorflow-cpu')}")
EOF
)
key="horovod-$HOROVOD_VERSION-$versions"
wheel_dir="$CACHE/$key"
hvd_stamp="$VENV/.toolkit-horovod"
if [ "$(cat "$hvd_stamp" 2>/dev/null)" != "$key" ]; then
  if ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
    log "building Horovod $HOROVOD_VERSION for $versions (once; about 10-15 minutes on 2 cores)"
    build=$(mktemp -d)
    trap 'rm -rf "$build"' EXIT
    "$PY" -m pip download -q --no-deps --no-binary :all: -d "$build" "horovod==$HOROVOD_VERSION"
    tar -xzf "$build"/horovod-$HOROVOD_VERSION.tar.gz -C "$build"
    src="$build/horovod-$HOROVOD_VERSION"
    # (1) PyTorch >= 2.1 needs C++17 (upstream PR 3998, never released).
    sed -i 's/CMAKE_CXX_STANDARD 14/CMAKE_CXX_STANDARD 17/' "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
    # (2) TF 2.21's wheel ships no XLA headers; the XLA ops are optional (jit_compile only).
    sed -i '/xla_mpi_ops.cc/d' "$src/horovod/tensorflow/CMakeLists.txt"
    grep -q 'CMAKE_CXX_STANDARD 17' "$src/horovod/torch/CMakeLists.txt" || die "Horovod patch (C++17) did not apply"
    ! grep -q 'xla_mpi_ops.cc' "$src/horovod/tensorflow/CMakeLists.txt" || die "Horovod patch (XLA ops) did not apply"
    mkdir -p "$wheel_dir.tmp"
    (cd "$src" && PATH="$VENV/bin:$PATH" HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_MPI=1 \
      HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=GLOO MAKEFLAGS=-j"$(nproc)" \
      "$PY" -m pip wheel -q --no-build-isolation --no-deps -w "$wheel_dir.tmp" . ) \
      || die "Horovod build failed (see the compiler output above).
HINT: it needs g++, cmake 3.x and MPI headers (libopenmpi-dev); set TOOLKIT_CACHE to a writable folder."
    rm -rf "$wheel_dir" && mv "$wheel_dir.tmp" "$wheel_dir"
  fi
  log "installing cached $(basename "$wheel_dir"/horovod-*.whl)"
  "$PY" -m pip install -q --no-deps --force-reinstall "$wheel_dir"/horovod-*.whl
  TF_CPP_MIN_LOG_LEVEL=3 "$PY" -c "import horovod.torch, horovod.tensorflow" 2>/dev/null \
    || die "the installed Horovod cannot load its PyTorch/TensorFlow extensions.
HINT: delete $wheel_dir and re-run to rebuild it against the installed frameworks."
  echo "$key" > "$hvd_stamp"
fi

# --- 4. The toolkit itself, editable (checked from / so the checkout's cwd does not count) ------
if [ "$(cd / && "$PY" -c 'import toolkit, adapters, os; print(os.path.dirname(os.path.dirname(toolkit.__file__)))' 2>/dev/null)" != "$ROOT" ]; then
  "$PY" -m pip install -q --no-deps --no-build-isolation -e "$ROOT"
fi
log "ready: $VENV ($key)"
