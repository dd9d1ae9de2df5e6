#!/usr/bin/env bash
# N runs (default 200) of a 2-rank gloo job that trains (stage 2, then stage 3 with NVMe
# offload), saves asynchronously and ends without destroy_process_group
# (tests/support/exit_worker.py train); counts non-zero exits and "terminate called" aborts
# (Note [clean exit] in zeroshard/comm/clean_exit.py). Run from the repository root.
set -uo pipefail
runs=${1:-200}
ok=0; bad=0; abort=0
for i in $(seq 1 "$runs"); do
  d=$(mktemp -d)
  out=$(OMP_NUM_THREADS=1 PYTHONPATH=. python -m torch.distributed.run --nproc-per-node 2 \
        --master-port $((20000 + RANDOM % 20000)) tests/support/exit_worker.py train "$d" 2>&1); rc=$?
  if [ $rc -eq 0 ]; then ok=$((ok + 1)); else bad=$((bad + 1)); echo "run $i: exit $rc"; echo "$out" | tail -20; fi
  if grep -q "terminate called" <<<"$out"; then abort=$((abort + 1)); fi
  rm -rf "$d"
done
echo "runs=$runs exit0=$ok failed=$bad aborts=$abort"
