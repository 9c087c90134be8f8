#!/usr/bin/env bash
# Installs everything the toolkit needs, idempotently: re-running it is safe and fast.
#
#   tools/install.sh            system MPI (apt, when missing), the venv, Horovod
#   tools/install.sh --slurm    also the Slurm daemons and munge the tests start locally
#   tools/install.sh --gpu      the CUDA builds (torch's, tensorflow[and-cuda], jax[cudaN]) and
#                               Horovod with NCCL; the default where nvidia-smi lists a GPU
#   tools/install.sh --cpu      the CPU builds, whatever the machine has
#   tools/install.sh --plan     print what would be installed and built; change nothing
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
DEVICE=auto
PLAN=0
for arg in "$@"; do
  case "$arg" in
    --slurm) WITH_SLURM=1 ;;
    --gpu) DEVICE=gpu ;;
    --cpu) DEVICE=cpu ;;
    --plan) PLAN=1 ;;
    *) echo "install.sh: unknown option '$arg' (valid: --slurm, --gpu, --cpu, --plan)" >&2; exit 2 ;;
  esac
done

log() { printf '[install] %s\n' "$*" >&2; }
die() { printf '[install] ERROR: %s\n' "$*" >&2; exit 1; }

# --- 0. The device: the CUDA builds where the NVIDIA driver lists a GPU -----------------------
# The driver's CUDA version (nvidia-smi's header) picks the CUDA major of the wheels; the GPUs'
# compute capabilities are the targets Horovod's NCCL operations are compiled for.
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
cuda=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p' | head -n 1 || true)
if [ "$DEVICE" = auto ]; then
  if [ "${gpus:-0}" -gt 0 ] && [ -n "$cuda" ]; then DEVICE=gpu; else DEVICE=cpu; fi
fi
cuda_tag=""
if [ "$DEVICE" = gpu ]; then
  [ "${gpus:-0}" -gt 0 ] && [ -n "$cuda" ] || die "--gpu, but nvidia-smi lists no GPU with a CUDA driver.
HINT: run this on a GPU node (e.g. inside 'srun --gres=gpu:1 ...'), or install the CPU builds with --cpu."
  cuda_major=${cuda%%.*}
  capabilities=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | sort -u | paste -sd';' - || true)
  cuda_tag="cu${cuda_major}"
  device_line="gpu: $gpus GPU(s), driver CUDA $cuda, compute capability ${capabilities:-unknown}"
elif [ "${gpus:-0}" -gt 0 ]; then
  device_line="cpu ($gpus GPU(s) listed; the CPU builds were asked for)"
else
  device_line="cpu (no NVIDIA GPU found)"
fi
log "device: $device_line"

# The package set: the CPU wheels, or their CUDA builds in their place (the same versions).
requirements() {
  if [ "$DEVICE" = gpu ]; then
    sed -e "s/^tensorflow-cpu\$/tensorflow[and-cuda]/" -e "s/^jax\$/jax[cuda${cuda_major}]/" \
        "$ROOT/requirements.txt"
  else
    cat "$ROOT/requirements.txt"
  fi
}
pin() { sed -n "s/^$1==//p" "$ROOT/constraints.txt"; }
if [ "$PLAN" = 1 ]; then
  py_tag=$("$PYTHON" -c 'import sys; print(f"py{sys.version_info[0]}{sys.version_info[1]}")')
  key="horovod-$HOROVOD_VERSION-$py_tag-torch$(pin torch)-tf$(pin tensorflow-cpu)${cuda_tag:+-$cuda_tag}"
  log "packages: $(requirements | grep -E '^(torch|tensorflow|jax)' | paste -sd' ' -) (versions: constraints.txt)"
  if [ "$DEVICE" = gpu ]; then
    log "horovod: HOROVOD_GPU_OPERATIONS=NCCL for compute capability ${capabilities:-unknown}, cached as $key"
  else
    log "horovod: HOROVOD_CPU_OPERATIONS=GLOO, cached as $key"
  fi
  exit 0
fi

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
want=$( (requirements; cat "$ROOT/constraints.txt") | sha256sum | cut -d' ' -f1)
if [ ! -x "$VENV/bin/python" ]; then
  log "creating virtual environment $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  log "installing pinned Python packages (first time: several minutes, ~3 GB)"
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q -c "$ROOT/constraints.txt" -r <(requirements)
  if [ "$DEVICE" = gpu ]; then  # PyPI's Linux torch wheel is the CUDA build: check, not assume
    "$PY" -c 'import torch, sys; sys.exit(torch.version.cuda is None)' \
      || die "the installed torch is a CPU build.
HINT: install torch==$(pin torch) from https://download.pytorch.org/whl/$cuda_tag into $VENV, then re-run."
  fi
  echo "$want" > "$stamp"
fi

# --- 3. Horovod, built once from the sdist and cached as a wheel keyed by versions ----------
# Versions come from package metadata (no framework import), so a re-run takes seconds.
versions=$("$PY" - <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version
torch = version("torch").split("+")[0]
try:
    tf = version("tensorflow-cpu")
except PackageNotFoundError:  # the CUDA build
    tf = version("tensorflow")
print(f"py{sys.version_info[0]}{sys.version_info[1]}-torch{torch}-tf{tf}")
EOF
)
key="horovod-$HOROVOD_VERSION-$versions${cuda_tag:+-$cuda_tag}"
wheel_dir="$CACHE/$key"
hvd_stamp="$VENV/.toolkit-horovod"
if [ "$(cat "$hvd_stamp" 2>/dev/null)" != "$key" ]; then
  if ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
    log "building Horovod $HOROVOD_VERSION for $versions (once; about 10-15 minutes on 2 cores)"
    rm -rf "$wheel_dir.tmp"
    BUILD_DEVICE=$DEVICE CUDA_CC_LIST=${capabilities:-} "$ROOT/tools/build_horovod.sh" "$PY" "$wheel_dir.tmp"
    rm -rf "$wheel_dir" && mv "$wheel_dir.tmp" "$wheel_dir"
  fi
  log "installing cached $(basename "$wheel_dir"/horovod-*.whl)"
  "$PY" -m pip install -q --no-deps --force-reinstall "$wheel_dir"/horovod-*.whl
  rm -f "$VENV/.toolkit-horovod-runner.patch"  # a fresh launcher: patched below
  TF_CPP_MIN_LOG_LEVEL=3 "$PY" -c "import horovod.torch, horovod.tensorflow" 2>/dev/null \
    || die "the installed Horovod cannot load its PyTorch/TensorFlow extensions.
HINT: delete $wheel_dir and re-run to rebuild it against the installed frameworks."
  echo "$key" > "$hvd_stamp"
fi

# --- 3b. horovodrun's launcher (pure Python), patched in place: a rank's own exit status passed
# on without a traceback, the signal it received forwarded to the ranks, a signal handler that
# takes no lock, no TensorFlow start-up lines (tools/patches/horovod-runner.patch, docs/launchers.md)
site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
launcher_patch="$ROOT/tools/patches/horovod-runner.patch"
applied="$VENV/.toolkit-horovod-runner.patch"  # the patch the installed launcher carries
if ! cmp -s "$launcher_patch" "$applied"; then
  if [ -f "$applied" ]; then
    patch -p1 -R -s -f -d "$site" < "$applied" >/dev/null || die "could not take back the previous launcher patch in $site/horovod.
HINT: delete $hvd_stamp and re-run to reinstall Horovod $HOROVOD_VERSION."
  fi
  patch -p1 -s -f -N -d "$site" < "$launcher_patch" >/dev/null \
    || die "horovodrun's launcher patch did not apply to $site/horovod.
HINT: delete $hvd_stamp and re-run to reinstall Horovod $HOROVOD_VERSION, then the patch."
  find "$site/horovod" -name '*.orig' -delete
  cp "$launcher_patch" "$applied"
  log "patched horovodrun's launcher"
fi

# --- 4. The toolkit itself, editable (checked from / so the checkout's cwd does not count) ------
if [ "$(cd / && "$PY" -c 'import toolkit, adapters, os; print(os.path.dirname(os.path.dirname(toolkit.__file__)))' 2>/dev/null)" != "$ROOT" ]; then
  "$PY" -m pip install -q --no-deps --no-build-isolation -e "$ROOT"
fi
log "ready: $VENV ($key)"
