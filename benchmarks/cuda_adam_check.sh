#!/usr/bin/env bash
# On a machine with a CUDA GPU and a CUDA build of torch: build the CUDA Adam kernel just in
# time, run its tests, and report its bandwidth as a fraction of the device copy bandwidth.
# Meant to finish in a few minutes:   bash benchmarks/cuda_adam_check.sh [results-dir]
set -euo pipefail
cd "$(dirname "$0")/.."
out_dir="${1:-${OUT:-/tmp}}"
mkdir -p "$out_dir"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export ZEROSHARD_CACHE_DIR="${ZEROSHARD_CACHE_DIR:-/tmp/zeroshard-jit}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
PY="${PYTHON:-python3}"

"$PY" - <<'PY'
import sys, torch
print(f"torch {torch.__version__} cuda {torch.version.cuda} device "
      f"{torch.cuda.get_device_name() if torch.cuda.is_available() else None}")
if torch.version.cuda is None or not torch.cuda.is_available():
    sys.exit("cuda_adam_check: needs a CUDA build of torch and a visible GPU")
PY

echo "== build (JIT) and status"
time "$PY" -m zeroshard.ops 2>&1 | tee "$out_dir/cuda_adam_status.txt"
grep -q "cuda_adam  ACTIVE" "$out_dir/cuda_adam_status.txt" || { echo "CUDA kernel did not build"; exit 1; }

echo "== tests"
"$PY" -m pytest -q -p no:cacheprovider tests/ops/test_ops_cuda.py tests/ops/test_ops_adam.py 2>&1 \
  | tee "$out_dir/cuda_adam_tests.txt" | tail -5

echo "== bandwidth"
"$PY" benchmarks/bench_adam_cuda.py --numel "${NUMEL_M:-100}" --rounds 20 --out "$out_dir/cuda_adam_bench.json" \
  | tee "$out_dir/cuda_adam_bench.txt"
