#!/usr/bin/env bash
# The bench-memory table on a CUDA machine, with torch.cuda.max_memory_allocated per rank,
# in one short run (a few minutes on one GPU):
#
#   bash benchmarks/gpu_check.sh [results-dir]        # default: $OUT, else /tmp/zeroshard-gpu
#
# Ranks share the visible GPUs round-robin (rank r uses cuda:r % device_count) and talk over
# gloo, which carries CUDA tensors for the all-reduce and broadcast zeroshard uses on gloo;
# NCCL refuses two ranks on one GPU, so gloo is what lets one GPU show world sizes 1, 2, 4.
# Each rank has its own CUDA caching allocator, so max_memory_allocated is per rank.
# Writes memory.md / memory.csv / memory.json / memory.png (bf16 and fp32) and an estimate
# table for the same model into the results directory.
set -uo pipefail
cd "$(dirname "$0")/.."
out_dir="${1:-${OUT:-/tmp/zeroshard-gpu}}"
mkdir -p "$out_dir"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export ZEROSHARD_CACHE_DIR="${ZEROSHARD_CACHE_DIR:-/tmp/zeroshard-jit}"
PY="${PYTHON:-python3}"
MODEL="${MODEL:-large}"

"$PY" - <<'PY' 2>&1 | tee "$out_dir/gpu_env.txt"
import sys, torch
print(f"torch {torch.__version__} cuda {torch.version.cuda} devices {torch.cuda.device_count()} "
      f"{torch.cuda.get_device_name() if torch.cuda.is_available() else None}")
if not torch.cuda.is_available():
    sys.exit("gpu_check: needs a CUDA build of torch and a visible GPU")
PY
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 1

status=0
for precision in bf16 fp32; do
  flag=(); [ "$precision" = bf16 ] && flag=(--mixed-precision bf16)
  echo "== bench memory ($precision, model $MODEL)"
  timeout "${STEP_TIMEOUT:-240}" "$PY" -m zeroshard.bench memory --model "$MODEL" --world-sizes 1,2,4 \
      --configs 0,1,2,3,2+cpu,2+nvme,3+cpu+cpu "${flag[@]}" --out "$out_dir/memory-$precision" \
      2> "$out_dir/memory-$precision.log" | tee "$out_dir/memory-$precision.txt" || status=1
  tail -3 "$out_dir/memory-$precision.log"
done

echo "== estimate for the same model on this GPU"
"$PY" - "$MODEL" <<'PY' 2>&1 | tee "$out_dir/estimate.txt"
import sys, torch
from zeroshard.bench.models import ModelSource
from zeroshard.planner import Hardware, Workload, plan
from zeroshard.planner.report import plan_markdown
src = ModelSource.parse(sys.argv[1])
hw = Hardware(gpu_memory=torch.cuda.get_device_properties(0).total_memory, n_gpus=4, cpu_memory=64 << 30, nvme=32 << 30)
print(plan_markdown(plan(src.shape(), hw, Workload(micro_batch=1, seq_len=src.seq_len))))
PY
exit $status
