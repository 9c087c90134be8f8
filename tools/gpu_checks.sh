#!/usr/bin/env bash
# The checks that need a GPU (docs/gpu.md), as one script for a GPU machine that has torch and
# JAX with CUDA but no Horovod and no package registry.
#
#   tools/gpu_checks.sh --prepare      here, with a registry: Horovod's sdist into .gpu/
#   tools/gpu_checks.sh [OUT_DIR]      there (OUT_DIR default: $OUT, else /tmp/gpu-checks)
#
# There, in order, within BUDGET seconds (default 530: one call of the GPU tool, 10 minutes,
# less the copies), each phase bounded by the time left, correctness before speed:
#   1. the machine: GPUs, driver, Python, torch, JAX              -> OUT/env.txt
#   2. Horovod 0.28.1 built twice in the background, for the GPU's compute capability, PyTorch
#      only, Gloo between processes: with NCCL, and without it (collectives host-staged)
#                                                                   -> OUT/horovod-*build.log
#   3. meanwhile, JAX's gpu-marked tests (jax-pjit, jax-pmap: world size 1 equivalence with
#      full float32 matmuls, checkpoints between GPU and CPU)      -> OUT/jax.log
#   4. horovod-torch's gpu-marked tests, once Horovod is built     -> OUT/torch.log
#   5. GPT-2 small's tokens/s, MFU and peak memory, the Trainer beside a hand-written loop,
#      jax-pjit then horovod-torch, in bf16-mixed and then in float32 (after the builds:
#      nothing else uses the cores)                                  -> OUT/throughput.log
#   6. two horovod-torch ranks sharing the GPU through the Horovod without NCCL
#      (TOOLKIT_SHARE_GPUS=1): data, ZeRO-3 and a two-stage pipeline against the float64
#      reference                                                    -> OUT/shared.log
#   7. a summary                                                     -> OUT/summary.txt
# TensorFlow is not on that machine: horovod-tf's GPU test reports itself skipped. The GPU tool
# carries .gpu/ only when asked: carry [".gpu"].
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SDIST=${HOROVOD_SDIST:-$ROOT/.gpu/horovod-0.28.1.tar.gz}

if [ "${1:-}" = --prepare ]; then
  mkdir -p "$ROOT/.gpu"
  "${PYTHON:-$ROOT/.venv/bin/python}" -m pip download -q --no-deps --no-binary :all: \
    -d "$ROOT/.gpu" horovod==0.28.1
  ls -l "$SDIST"
  exit
fi

OUT_DIR=${1:-${OUT:-/tmp/gpu-checks}}
BUDGET=${BUDGET:-530}
mkdir -p "$OUT_DIR"
PY=${PYTHON:-python3}
BASE_PATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONPATH="$BASE_PATH" PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
cd "$ROOT"
say() { printf '[gpu-checks %3ds] %s\n' "$SECONDS" "$*" | tee -a "$OUT_DIR/summary.txt"; }
left() { echo $(( BUDGET - SECONDS )); }
phase() {  # phase NAME SECONDS LOG COMMAND...: runs it within SECONDS and the time left
  local name=$1 limit=$2 log=$3; shift 3
  [ "$(left)" -lt "$limit" ] && limit=$(left)
  if [ "$limit" -lt 20 ]; then say "$name: not run (no time left)"; return 1; fi
  timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  say "$name: $([ $rc = 0 ] && echo ok || { [ $rc = 124 ] && echo "stopped at ${limit}s" || echo "exit $rc"; })"
  return $rc
}
install_wheel() {  # install_wheel DIR TARGET: the one wheel built into DIR
  rm -rf "$2" && "$PY" -m pip install -q --no-deps --no-index --target "$2" "$1"/horovod-*.whl
}

# 1. the machine
{ nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total --format=csv
  "$PY" -c 'import sys, torch, jax; print(sys.version); print("torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name()); print("jax", jax.__version__, jax.devices())'
  command -v nvcc cmake || ls /usr/local/cuda/bin/nvcc
} >"$OUT_DIR/env.txt" 2>&1
cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | sort -u | paste -sd';' -)
say "machine: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1), compute capability $cc"
[ -f "$SDIST" ] || say "no $SDIST: run tools/gpu_checks.sh --prepare here, and carry .gpu"

# 2. Horovod with NCCL, and without (host-staged), in the background, half the cores each
WHEELS=/tmp/gpu-checks-horovod
half=$(( $(nproc) / 2 > 1 ? $(nproc) / 2 : 1 ))
build_limit=$(( BUDGET / 2 ))
( BUILD_DEVICE=gpu CUDA_CC_LIST=$cc WITH_TENSORFLOW=0 WITH_MPI=0 HOROVOD_SDIST=$SDIST \
    MAKEFLAGS=-j$half timeout $build_limit "$ROOT/tools/build_horovod.sh" "$PY" "$WHEELS/nccl" ) \
  >"$OUT_DIR/horovod-build.log" 2>&1 &
build=$!
( BUILD_DEVICE=cpu WITH_TENSORFLOW=0 WITH_MPI=0 HOROVOD_SDIST=$SDIST \
    MAKEFLAGS=-j$half timeout $build_limit "$ROOT/tools/build_horovod.sh" "$PY" "$WHEELS/gloo" ) \
  >"$OUT_DIR/horovod-gloo-build.log" 2>&1 &
gloo_build=$!

# 3. JAX on the GPU, meanwhile
phase "jax gpu tests" 200 "$OUT_DIR/jax.log" "$PY" -m pytest -m gpu -ra -q -p no:cacheprovider \
  -k "jax" tests/test_gpu.py

# 4. horovod-torch on the GPU
nccl_ok=0
if wait $build && install_wheel "$WHEELS/nccl" /tmp/gpu-checks-nccl >>"$OUT_DIR/horovod-build.log" 2>&1; then
  nccl_ok=1
  export PYTHONPATH="$BASE_PATH:/tmp/gpu-checks-nccl"
  say "horovod with NCCL: $("$PY" -c 'import horovod.torch as h; print("nccl_built", h.nccl_built(), "gloo_built", h.gloo_built())' 2>&1 | tail -n 1)"
  phase "horovod-torch gpu tests" 200 "$OUT_DIR/torch.log" "$PY" -m pytest -m gpu -ra -q \
    -p no:cacheprovider -k "not jax" tests/test_gpu.py tests/toolkit/test_devices.py
else
  say "horovod with NCCL: build failed or stopped (horovod-build.log, last lines below)"
  tail -n 15 "$OUT_DIR/horovod-build.log"
fi

# 5. throughput, once no build uses the cores
wait $gloo_build; gloo_rc=$?
GPT=(--device gpu --gpt2-small --vocab 50304 --batch-size 8 --steps 5 --windows 4)
for precision in bf16-mixed 32; do
  name=$([ $precision = 32 ] && echo float32 || echo $precision)
  phase "jax-pjit GPT-2 small $name" 80 "$OUT_DIR/throughput.log" \
    "$PY" benchmarks/gpt_throughput.py --backend jax-pjit --precision $precision "${GPT[@]}"
  [ $nccl_ok = 1 ] && phase "horovod-torch GPT-2 small $name" 80 "$OUT_DIR/throughput.log" \
    "$PY" benchmarks/gpt_throughput.py --backend horovod-torch --precision $precision "${GPT[@]}"
done

# the update's modes: the skip kept on the device against the skip read after each step
phase "jax-pjit update modes" 60 "$OUT_DIR/modes.log" \
  "$PY" benchmarks/update_modes.py --backend jax-pjit --device gpu --windows 3

# 6. two ranks sharing the GPU through host-staged collectives
if [ $gloo_rc = 0 ] && install_wheel "$WHEELS/gloo" /tmp/gpu-checks-gloo >>"$OUT_DIR/horovod-gloo-build.log" 2>&1; then
  phase "horovod-torch 2 ranks on one GPU (host-staged)" 150 "$OUT_DIR/shared.log" \
    env PYTHONPATH="$BASE_PATH:/tmp/gpu-checks-gloo" PATH="/tmp/gpu-checks-gloo/bin:$PATH" \
    TOOLKIT_SHARE_GPUS=1 "$PY" -m adapters.equivalence --backends horovod-torch --world-sizes 2 \
    --launcher horovodrun --device gpu --layout data,sharded:3,pipeline:2:4 --steps 20
else
  say "two ranks on one GPU: not run (the build without NCCL failed: horovod-gloo-build.log)"
fi

# 7. the summary: each phase's line above, then the tests' and benchmarks' own last lines
for log in jax torch throughput modes shared; do
  [ -f "$OUT_DIR/$log.log" ] && grep -E "passed|failed|skipped|tokens/s|SKIPPED|FAILED|Error|PASS|FAIL|^(data|sharded:3) " \
    "$OUT_DIR/$log.log" | tail -n 20 | sed "s/^/$log: /" | tee -a "$OUT_DIR/summary.txt"
done
say "done"
