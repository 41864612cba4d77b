#!/usr/bin/env bash
# Qwen3-0.6B and 1.7B training steps on one NVIDIA GPU (prepared for a lent H200: 15 minutes of
# device time, start included, so this aims to finish in under 10).
#
#   bash benchmarks/gpu.sh [bench_gpu.py options, e.g. --batch 8 --ac full]
#
# 1. a venv (.venv-gpu, or $GPU_VENV) with titan-jax and jax[cuda12]==0.10.2 (jax-cuda12-plugin and
#    jax-cuda12-pjrt 0.10.2, the CUDA plugin matching the jax we pin) from the package registry
#    (several GB of CUDA wheels: too big to carry, so a registry must be reachable);
# 2. checks that JAX sees a GPU;
# 3. benchmarks/bench_gpu.py: bf16 steps, tokens/s, MFU against the published dense bf16 peak,
#    peak memory; attention cudnn when the config has model.attention, else the default.
# Results: $OUT/gpu_bench-<time>.{json,md}, or outputs/gpu/ when OUT is unset.
set -euo pipefail
cd "$(dirname "$0")/.."
BUDGET_S=${GPU_BENCH_BUDGET_S:-570}  # whole script, install included
VENV=${GPU_VENV:-.venv-gpu}
PYTHON=${PYTHON:-python3}
OUT_DIR=${OUT:-outputs/gpu}
# The Makefile exports JAX_PLATFORMS=cpu on hosts without accelerator device files; here JAX
# must find the GPU itself.
unset JAX_PLATFORMS
log() { echo "[gpu.sh ${SECONDS}s] $*"; }
fail() { echo "gpu.sh: $*" >&2; exit 2; }

"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || fail "$PYTHON is older than Python 3.11 (titan-jax's minimum); set PYTHON=/path/to/python3.11+"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
NO_REGISTRY="no package registry answered from this machine (pip config list shows where pip
looks); this script installs jax[cuda12]==0.10.2 (several GB of CUDA wheels) and needs one"
log "checking that the package registry answers"
"$VENV/bin/pip" download -q --no-deps --retries 1 --timeout 20 -d "$(mktemp -d)" jax==0.10.2 \
  || fail "$NO_REGISTRY"
log "installing titan-jax with jax[cuda12]==0.10.2"
"$VENV/bin/pip" install -q --retries 2 --timeout 60 -e '.[gpu]' \
  || fail "installing jax[cuda12]==0.10.2 and titan-jax's dependencies into $VENV failed (above)"

log "checking that JAX sees a GPU"
"$VENV/bin/python" - <<'EOF' || fail "JAX found no GPU: see the error above (driver, CUDA plugin)"
import jax
devices = jax.devices()
print("jax", jax.__version__, devices)
if devices[0].platform != "gpu":
    raise SystemExit(f"first device is {devices[0].platform}, not gpu")
EOF

LEFT=$((BUDGET_S - SECONDS))
[ "$LEFT" -gt 90 ] || fail "only ${LEFT}s of the ${BUDGET_S}s budget left after the install"
log "benchmarking (budget ${LEFT}s) into $OUT_DIR"
"$VENV/bin/python" benchmarks/bench_gpu.py --out "$OUT_DIR" --budget-s "$((LEFT - 20))" "$@"
log "done"
