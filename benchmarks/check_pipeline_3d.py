"""pp 2 x dp 2 x tp 2 on 8 gloo ranks (about 2 minutes on 2 cores; too slow for the test suite,
which runs pp 2 x dp 1 x tp 2 in tests/dist/test_pipeline.py):

    PYTHONPATH=. python benchmarks/check_pipeline_3d.py

The Llama of tests/support/pipeline_worker.py in 2 stages (1F1B, 4 micro-batches), each stage's linear
layers parallelised over "tp" and sharded by ZeroOptimizer (stage 2) over "dp", 8 steps with
clipping against single-process torch.optim.AdamW on the same global batch. Prints, per rank,
the weights' largest difference (relative to each tensor's largest weight, absolute, and
relative in norm) and the dp reduction traffic against one reduction of each unit per step;
exits 1 when a bound fails (1e-5 relative in norm and 1e-5 absolute, as the suite's TP case).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.support import pipeline_worker as w  # noqa: E402
from tests.support.dist_results import run_ranks  # noqa: E402


def worker(rank: int, world: int, out_path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    ref, _ = w.reference()
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    t = w.Trainer(mesh, 2, "1f1b")
    t.opt.comm_report(reset=True)
    for step in range(w.STEPS):
        t.step(step)
    got = t.weights()
    calls, nbytes = w.dp_bytes(t.opt.comm_report())
    out = {"rel": w.max_rel(got, ref), "abs": max(float((got[n] - ref[n]).abs().max()) for n in got),
           "rel_norm": max(float((got[n] - ref[n]).norm() / ref[n].norm()) for n in got),
           "dp_calls": calls, "dp_bytes": nbytes, "units": len(t.opt.units),
           "one_per_step": w.STEPS * sum(u.layout.padded_numel * u.flat.element_size() for u in t.opt.units)}
    t.close()
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump(out, f)


def main() -> int:
    start = time.time()
    with tempfile.TemporaryDirectory() as d:
        ranks = run_ranks(worker, 8, d)
    ok = True
    for i, r in enumerate(ranks):
        good = (r["rel_norm"] < 1e-5 and r["abs"] < 1e-5 and r["dp_bytes"] == r["one_per_step"]
                and r["dp_calls"] == w.STEPS * r["units"])
        ok &= good
        print(f"rank {i}: {json.dumps(r)}{'' if good else '  FAILED'}")
    print(f"{time.time() - start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
