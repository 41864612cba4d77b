#!/usr/bin/env bash
# Qwen3-0.6B and 1.7B (and the MoE debug model) training steps on one NVIDIA GPU, on the stack
# the lent machine already has (an H200: Python 3.12, jax 0.11.2 with its CUDA 13 plugin, flax,
# optax, orbax, tokenizers, safetensors; no package registry): nothing is installed, titan-jax
# runs from this checkout through PYTHONPATH. 15 minutes of device time, start included, so
# this aims to finish in under 10.
#
#   bash benchmarks/gpu.sh [bench_gpu.py options, e.g. --batch 8 --ac full]
#
# 1. prints every version that matters and checks that JAX sees a GPU;
# 2. a one-step smoke test of a tiny model on the GPU (the whole path, in seconds);
# 3. benchmarks/bench_gpu.py: bf16 steps, tokens/s, MFU against the published dense bf16 peak
#    (H200: 989 TFLOP/s), peak memory; attention cudnn when the config accepts it.
# Results: $OUT/gpu_bench-<time>.{json,md}, or outputs/gpu/ when OUT is unset.
set -euo pipefail
cd "$(dirname "$0")/.."
BUDGET_S=${GPU_BENCH_BUDGET_S:-570}  # whole script
PYTHON=${PYTHON:-python3}
OUT_DIR=${OUT:-outputs/gpu}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# The Makefile exports JAX_PLATFORMS=cpu on hosts without accelerator device files; here JAX
# must find the GPU itself.
unset JAX_PLATFORMS
log() { echo "[gpu.sh ${SECONDS}s] $*"; }
fail() { echo "gpu.sh: $*" >&2; exit 2; }

"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 12))' \
  || fail "$PYTHON is older than Python 3.12 (titan-jax's minimum); set PYTHON=/path/to/python3.12+"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

log "versions, and whether JAX sees a GPU"
"$PYTHON" benchmarks/bench_gpu.py --versions \
  || fail "JAX found no GPU, or a package titan-jax needs is missing: see above"

log "one-step smoke test on the GPU"
"$PYTHON" benchmarks/bench_gpu.py --smoke --steps 1 --warmup 0 --out "$OUT_DIR/smoke" \
  || fail "the one-step smoke test failed (above): not starting the timed rows"

LEFT=$((BUDGET_S - SECONDS))
[ "$LEFT" -gt 90 ] || fail "only ${LEFT}s of the ${BUDGET_S}s budget left after the smoke test"
log "benchmarking (budget ${LEFT}s) into $OUT_DIR"
"$PYTHON" benchmarks/bench_gpu.py --out "$OUT_DIR" --budget-s "$((LEFT - 20))" "$@"
log "done"
