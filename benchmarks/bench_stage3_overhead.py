"""Stage 3's CPU cost per phase against plain torch.optim, same model, same run.

    python benchmarks/bench_stage3_overhead.py --layers 12 --steps 7 --dir /tmp/zs-overhead

Each placement trains in a fresh process (no memory limit): forward, backward and the
optimizer step (clip_grad_norm_ + step + zero_grad) are timed separately and the medians of
steps 2..N reported, with each phase as a multiple of plain ``torch.optim.AdamW`` (eager
model, ``torch.nn.utils.clip_grad_norm_``) measured in the same run:
- "stage 3": ``ZeroOptimizer(stage=3)``, everything in memory (world size 1: gathers are
  copies, so what is left over plain torch is zeroshard's own work);
- "auto, half the state": ``offload="auto"`` with a host budget of the planner's minimum plus
  half of the state (NVMe for the rest, as in bench_bigger_than_memory.py --auto);
- "all NVMe": ``offload_optimizer="nvme", offload_params="nvme"``.
The ratios are noisy on a shared 2-core machine; the script prints every step's time too.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

MODES = ("plain", "stage 3", "auto, half the state", "all NVMe")


def child(args: argparse.Namespace) -> None:
    import torch
    import zeroshard
    from zeroshard.bench.phases import timed_step
    from zeroshard.planner.auto_placement import PlacementError
    from zeroshard.toy import GPTConfig, TinyGPT, synthetic_batch
    cfg = GPTConfig(vocab=4096, d_model=args.d_model, n_layers=args.layers, n_heads=12, seq_len=64)
    swap = os.path.join(args.dir, "swap")
    os.makedirs(swap, exist_ok=True)

    def build(**place):
        with torch.device("meta"):
            model = TinyGPT(cfg)
        return model, zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-4, weight_decay=0.01,
                                              stage=3, **place)
    if args.child == "plain":
        torch.manual_seed(0)
        model = TinyGPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    else:
        if args.child == "stage 3":
            place = {}
        elif args.child == "all NVMe":
            place = dict(offload_optimizer="nvme", offload_params="nvme", nvme_path=swap)
        else:
            try:
                build(offload="auto", memory_budget={"host": 1}, nvme_path=swap)
                raise RuntimeError("a 1-byte budget was accepted")
            except PlacementError as exc:
                budget = exc.minimum["host"] + exc.state // 2
            # (each phase is compared with plain torch's: the step stays in its own phase)
            place = dict(offload="auto", memory_budget={"host": budget}, nvme_path=swap, overlap_step=False)
        model, opt = build(**place)
        zeroshard.init_meta_weights(model, seed=0)
    phases = []
    clip = ((lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)) if args.child == "plain"
            else (lambda: opt.clip_grad_norm_(1.0)))
    for step in range(args.steps):
        phases.append(timed_step(model, opt, synthetic_batch(step, 1, cfg), clip)[1])
        print(f"  {args.child} step {step + 1}: " + ", ".join(f"{k} {v:.2f}s" for k, v in phases[-1].items()),
              file=sys.stderr, flush=True)
    print(json.dumps({"phases": phases, "params": sum(p.numel() for p in model.parameters())}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=1536)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--dir", default="/tmp/zs-overhead", help="swap files go here (NVMe placements)")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    if args.steps < 2:
        ap.error("--steps must be at least 2 (step 1 is not counted)")
    results = {}
    for mode in MODES:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--layers", str(args.layers),
               "--d-model", str(args.d_model), "--steps", str(args.steps), "--dir", args.dir]
        out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
        rows = json.loads(out.stdout.strip().splitlines()[-1])
        counted = rows["phases"][1:]
        med = {k: statistics.median(r[k] for r in counted) for k in counted[0]}
        med["total"] = statistics.median(sum(r.values()) for r in counted)
        results[mode] = {"median_s": med, "steps": rows["phases"], "params": rows["params"]}
    plain = results["plain"]["median_s"]
    print(f"{results['plain']['params'] / 1e9:.3f} B parameters, {args.layers} blocks, medians of steps 2-{args.steps}")
    for mode, r in results.items():
        med = r["median_s"]
        r["over_plain"] = {k: med[k] / plain[k] for k in med}
        print(f"{mode:>22}: " + ", ".join(f"{k} {med[k]:.2f} s ({r['over_plain'][k]:.2f}x)" for k in med))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"layers": args.layers, "d_model": args.d_model, "load_average": os.getloadavg(),
                       "runs": results}, f, indent=1)


if __name__ == "__main__":
    main()
