#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: build ggml's CUDA module (make cuda), run the split-model
# tests on it (accuracy at every layer boundary, all 13 weight types, greedy agreement, prefix
# reuse, bad splits), then bench/offload.py against llama.cpp with the same CUDA module and
# n_gpu_layers. About 10 minutes on 16 cores, most of it the build (skipped when the module
# exists: FORCE=1 rebuilds). Output: $OUT (default build/gpu_check) holds the logs and JSON.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
PY=${PYTHON:-$ROOT/.venv/bin/python}
OUT=${OUT:-$ROOT/build/gpu_check}
mkdir -p "$OUT"
MODULE=${EDGEINFER_HOME:-$HOME/.cache/edgeinfer}/ggml/libggml-cuda.so
nvidia-smi --query-gpu=name,compute_cap,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"

if [ ! -f "$MODULE" ] || [ -n "${FORCE:-}" ]; then
  time bench/build_cuda.sh 2>&1 | tee "$OUT/build.log" | tail -5
fi

EDGEINFER_TEST_BACKEND=cuda "$PY" -m pytest tests/test_offload.py -q -p no:cacheprovider \
  -k "boundary or weight_type or greedy or prefix_cache" 2>&1 | tee "$OUT/tests.log" | tail -5

THREADS=$(nproc)
"$PY" bench/offload.py --backend cuda --threads "$THREADS" --save "$OUT/offload.json" \
  | tee "$OUT/offload.txt"
