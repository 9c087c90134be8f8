#!/usr/bin/env bash
# The checks that need a GPU (docs/gpu.md), as one script for a GPU machine that has torch and
# JAX with CUDA but no Horovod and no package registry.
#
#   tools/gpu_checks.sh --prepare      here, with a registry: Horovod's sdist into .gpu/
#   tools/gpu_checks.sh [OUT_DIR]      there (OUT_DIR default: $OUT, else /tmp/gpu-checks)
#
# There, in order, each phase bounded so that the whole fits in about nine minutes:
#   1. the machine: GPUs, driver, Python, torch, JAX              -> OUT/env.txt
#   2. Horovod 0.28.1 built with NCCL for the GPU's compute capability (PyTorch only, Gloo
#      between processes), in the background                       -> OUT/horovod-build.log
#   3. meanwhile, JAX on the GPU: the gpu-marked tests of jax-pjit and jax-pmap (world size 1
#      equivalence with full float32 matmuls, checkpoints between GPU and CPU), and GPT-2
#      small's tokens/s and MFU, Trainer beside a hand-written loop  -> OUT/jax.log
#   4. horovod-torch on the GPU, once Horovod is built: the same     -> OUT/torch.log
#   5. with time left: two horovod-torch ranks sharing the GPU through a Horovod built without
#      NCCL (host-staged collectives, built beside the other), data, ZeRO-3 and a two-stage
#      pipeline against the float64 reference                      -> OUT/shared.log
#   6. a summary                                                     -> OUT/summary.txt
# TensorFlow is not on that machine: horovod-tf's GPU test reports itself skipped.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SDIST="$ROOT/.gpu/horovod-0.28.1.tar.gz"

if [ "${1:-}" = --prepare ]; then
  mkdir -p "$ROOT/.gpu"
  "${PYTHON:-$ROOT/.venv/bin/python}" -m pip download -q --no-deps --no-binary :all: \
    -d "$ROOT/.gpu" horovod==0.28.1
  ls -l "$SDIST"
  exit
fi

OUT_DIR=${1:-${OUT:-/tmp/gpu-checks}}
mkdir -p "$OUT_DIR"
PY=${PYTHON:-python3}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
cd "$ROOT"
say() { printf '[gpu-checks %3ds] %s\n' "$SECONDS" "$*" | tee -a "$OUT_DIR/summary.txt"; }
phase() {  # phase NAME SECONDS LOG COMMAND...: runs it bounded, says how it ended
  local name=$1 limit=$2 log=$3; shift 3
  timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  say "$name: $([ $rc = 0 ] && echo ok || { [ $rc = 124 ] && echo "stopped at ${limit}s" || echo "exit $rc"; })"
  return $rc
}

# 1. the machine
{ nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total --format=csv
  "$PY" -c 'import sys, torch, jax; print(sys.version); print("torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name()); print("jax", jax.__version__, jax.devices())'
} >"$OUT_DIR/env.txt" 2>&1
cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | sort -u | paste -sd';' -)
say "machine: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1), compute capability $cc"

# 2. Horovod with NCCL, and one without (host-staged), in the background (the JAX phase uses
#    the GPU meanwhile)
WHEELS=/tmp/gpu-checks-horovod
half=$(( $(nproc) / 2 > 1 ? $(nproc) / 2 : 1 ))
( BUILD_DEVICE=gpu CUDA_CC_LIST=$cc WITH_TENSORFLOW=0 WITH_MPI=0 HOROVOD_SDIST=$SDIST \
    MAKEFLAGS=-j$half timeout 420 "$ROOT/tools/build_horovod.sh" "$PY" "$WHEELS/nccl" ) \
  >"$OUT_DIR/horovod-build.log" 2>&1 &
build=$!
( BUILD_DEVICE=cpu WITH_TENSORFLOW=0 WITH_MPI=0 HOROVOD_SDIST=$SDIST \
    MAKEFLAGS=-j$half timeout 420 "$ROOT/tools/build_horovod.sh" "$PY" "$WHEELS/gloo" ) \
  >"$OUT_DIR/horovod-gloo-build.log" 2>&1 &
gloo_build=$!

# 3. JAX on the GPU
phase "jax gpu tests" 200 "$OUT_DIR/jax.log" "$PY" -m pytest -m gpu -ra -q -p no:cacheprovider \
  -k "jax" tests/test_gpu.py
phase "jax-pjit GPT-2 small float32" 120 "$OUT_DIR/jax.log" "$PY" benchmarks/gpt_throughput.py \
  --backend jax-pjit --device gpu --gpt2-small --vocab 50304 --batch-size 8 --steps 5 --windows 5

# 4. horovod-torch on the GPU
if wait $build; then
  say "horovod built: $(ls "$WHEELS/nccl")"
  "$PY" -m pip install -q --no-deps --no-index --target /tmp/gpu-checks-nccl "$WHEELS"/nccl/horovod-*.whl \
    >>"$OUT_DIR/horovod-build.log" 2>&1
  export PYTHONPATH="$ROOT:/tmp/gpu-checks-nccl"
  "$PY" -c 'import horovod.torch as h; print("nccl_built", h.nccl_built(), "gloo_built", h.gloo_built())' \
    >>"$OUT_DIR/torch.log" 2>&1
  phase "horovod-torch gpu tests" 200 "$OUT_DIR/torch.log" "$PY" -m pytest -m gpu -ra -q \
    -p no:cacheprovider -k "not jax" tests/test_gpu.py tests/toolkit/test_devices.py
  phase "horovod-torch GPT-2 small float32" 120 "$OUT_DIR/torch.log" "$PY" \
    benchmarks/gpt_throughput.py --backend horovod-torch --device gpu --gpt2-small --vocab 50304 \
    --batch-size 8 --steps 5 --windows 5
else
  say "horovod build failed or stopped: see horovod-build.log (last lines below)"
  tail -n 15 "$OUT_DIR/horovod-build.log"
fi

# 5. two ranks sharing the GPU through host-staged collectives, with the time left
if [ "$SECONDS" -lt 420 ] && wait $gloo_build; then
  "$PY" -m pip install -q --no-deps --no-index --target /tmp/gpu-checks-gloo "$WHEELS"/gloo/horovod-*.whl \
    >>"$OUT_DIR/horovod-gloo-build.log" 2>&1
  phase "horovod-torch 2 ranks on one GPU (host-staged)" $(( 520 - SECONDS )) "$OUT_DIR/shared.log" \
    env PYTHONPATH="$ROOT:/tmp/gpu-checks-gloo" PATH="/tmp/gpu-checks-gloo/bin:$PATH" \
    TOOLKIT_SHARE_GPUS=1 "$PY" -m toolkit.equivalence --backends horovod-torch --world-sizes 2 --launcher horovodrun \
    --device gpu --layout data,sharded:3,pipeline:2:4 --steps 20
else
  say "two ranks on one GPU: not run (no time left, or the build without NCCL failed: horovod-gloo-build.log)"
fi

# 6. the summary: each phase's line above, then the tests' and benchmarks' own last lines
for log in jax torch shared; do
  [ -f "$OUT_DIR/$log.log" ] && grep -E "passed|failed|skipped|tokens/s|nccl_built|SKIPPED|FAILED|Error|PASS|FAIL" \
    "$OUT_DIR/$log.log" | tail -n 20 | sed "s/^/$log: /" | tee -a "$OUT_DIR/summary.txt"
done
say "done"
