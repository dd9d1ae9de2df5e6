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

``--paired`` measures plain torch and stage 3 in memory in ONE process instead, alternating a
step of each: both see the same load at the same time, so each pair's ratio is measured in one
window of a few seconds, and the median of the pairs' ratios is what is reported (on a machine
shared with other jobs, the per-process medians above can differ by 2x from load alone).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MODES = ("plain", "stage 3", "auto, half the state", "all NVMe")
SHORT = {"plain": "plain", "stage3": "stage 3", "auto-half": "auto, half the state", "nvme": "all NVMe"}


def parse_modes(text: str) -> frozenset:
    """``--modes``: placements by name or short name (plain, stage3, auto-half, nvme),
    comma-separated. A name may itself hold a comma ("auto, half the state"), so whole names
    are matched first, then the rest is split on commas."""
    found, rest = set(), text
    for name in sorted(MODES, key=len, reverse=True):
        if name in rest:
            found.add(name)
            rest = rest.replace(name, ",")
    for token in (t.strip() for t in rest.split(",")):
        if not token:
            continue
        if token not in SHORT:
            raise argparse.ArgumentTypeError(f"unknown placement {token!r}; choose from {list(MODES)} or their "
                                             f"short names {list(SHORT)}")
        found.add(SHORT[token])
    return frozenset(found)


def timed(m, o, batch, clip):
    """One step: (loss, wall seconds per phase, process CPU seconds per phase). The CPU time is
    what the load of other jobs on a shared machine moves least (it still moves: caches, and
    OpenMP threads spinning while they wait for a core)."""
    marks = [(time.perf_counter(), time.process_time())]
    loss = m(*batch)
    marks.append((time.perf_counter(), time.process_time()))
    loss.backward()
    marks.append((time.perf_counter(), time.process_time()))
    clip()
    o.step()
    o.zero_grad()
    marks.append((time.perf_counter(), time.process_time()))
    names = ("forward", "backward", "step")
    return loss, ({k: marks[i + 1][0] - marks[i][0] for i, k in enumerate(names)},
                  {k: marks[i + 1][1] - marks[i][1] for i, k in enumerate(names)})


def child(args: argparse.Namespace) -> None:
    import torch
    import zeroshard
    from zeroshard.planner.auto_placement import PlacementError
    from zeroshard.testing.toy import GPTConfig, TinyGPT, synthetic_batch
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
    phases, cpu = [], []
    clip = ((lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)) if args.child == "plain"
            else (lambda: opt.clip_grad_norm_(1.0)))
    for step in range(args.steps):
        _, (wall, cpu_s) = timed(model, opt, synthetic_batch(step, 1, cfg), clip)
        phases.append(wall)
        cpu.append(cpu_s)
        print(f"  {args.child} step {step + 1}: " + ", ".join(f"{k} {v:.2f}s" for k, v in phases[-1].items()),
              file=sys.stderr, flush=True)
    print(json.dumps({"phases": phases, "cpu": cpu, "params": sum(p.numel() for p in model.parameters())}))


def paired(args: argparse.Namespace) -> dict:
    """Plain torch and stage 3 (in memory) in one process, a step of each in turn."""
    import torch
    import zeroshard
    from zeroshard.testing.toy import GPTConfig, TinyGPT, synthetic_batch
    cfg = GPTConfig(vocab=4096, d_model=args.d_model, n_layers=args.layers, n_heads=12, seq_len=64)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    plain = TinyGPT(cfg)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-4, weight_decay=0.01)
    with torch.device("meta"):
        model = TinyGPT(cfg)
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-4, weight_decay=0.01, stage=3)
    zeroshard.init_meta_weights(model, seed=0)
    runs: dict[str, list] = {"plain": [], "stage 3": []}
    cpu: dict[str, list] = {"plain": [], "stage 3": []}
    losses: list[float] = []

    for step in range(args.steps):
        batch = synthetic_batch(step, 1, cfg)
        order = [("plain", plain, plain_opt), ("stage 3", model, opt)]
        for name, m, o in order if step % 2 == 0 else order[::-1]:  # (neither always runs first)
            clip = ((lambda: torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)) if name == "plain"
                    else (lambda: opt.clip_grad_norm_(1.0)))
            loss, (phases, cpu_s) = timed(m, o, batch, clip)
            runs[name].append(phases)
            cpu[name].append(cpu_s)
            if name == "stage 3":
                losses.append(float(loss))
            print(f"  {name} step {step + 1}: " + ", ".join(f"{k} {v:.2f}s" for k, v in phases.items()),
                  file=sys.stderr, flush=True)
    def pair_ratios(rows):
        return {k: statistics.median(s[k] / p[k] for p, s in zip(rows["plain"][1:], rows["stage 3"][1:]))
                for k in rows["plain"][0]}
    ratios, cpu_ratios = pair_ratios(runs), pair_ratios(cpu)
    med = {name: {k: statistics.median(r[k] for r in rows[1:]) for k in rows[0]} for name, rows in runs.items()}
    print(f"paired, {sum(p.numel() for p in plain.parameters()) / 1e9:.3f} B parameters, {args.layers} blocks, "
          f"steps 2-{args.steps}: median of each pair's stage 3 / plain: "
          + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items())
          + "; in process CPU time: " + ", ".join(f"{k} {v:.2f}x" for k, v in cpu_ratios.items()))
    for name, m in med.items():
        print(f"{name:>10}: " + ", ".join(f"{k} {v:.2f} s" for k, v in m.items()))
    return {"paired": True, "pair_ratio_median": ratios, "pair_cpu_ratio_median": cpu_ratios, "median_s": med,
            "steps": runs, "cpu_steps": cpu, "losses": losses, "threads": torch.get_num_threads(),
            "load_average": os.getloadavg()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=1536)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--dir", default="/tmp/zs-overhead", help="swap files go here (NVMe placements)")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--paired", action="store_true",
                    help="plain torch and stage 3 in memory alternating in one process (see the docstring)")
    ap.add_argument("--modes", type=parse_modes, default=frozenset(MODES),
                    help="comma-separated placements to run, by name or short name "
                         f"({', '.join(SHORT)}; plain always runs: the ratios are to it)")
    ap.add_argument("--threads", type=int, default=0, help="--paired: torch threads (0: torch's default)")
    ap.add_argument("--dry-run", action="store_true", help="print the runs the options select (one process per "
                                                           "placement) and exit without measuring")
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    if args.steps < 2:
        ap.error("--steps must be at least 2 (step 1 is not counted)")
    if args.paired:
        out = paired(args)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"layers": args.layers, "d_model": args.d_model, **out}, f, indent=1)
        return
    wanted = args.modes
    results = {}
    for mode in (m for m in MODES if m == "plain" or m in wanted):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--layers", str(args.layers),
               "--d-model", str(args.d_model), "--steps", str(args.steps), "--dir", args.dir]
        if args.dry_run:
            print(f"{mode}: {' '.join(cmd[1:])}")
            continue
        out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
        rows = json.loads(out.stdout.strip().splitlines()[-1])
        counted = rows["phases"][1:]
        med = {k: statistics.median(r[k] for r in counted) for k in counted[0]}
        med["total"] = statistics.median(sum(r.values()) for r in counted)
        cpu_med = {k: statistics.median(r[k] for r in rows["cpu"][1:]) for k in counted[0]}
        results[mode] = {"median_s": med, "median_cpu_s": cpu_med, "steps": rows["phases"], "cpu_steps": rows["cpu"],
                         "params": rows["params"]}
    if args.dry_run:
        return
    plain = results["plain"]["median_s"]
    print(f"{results['plain']['params'] / 1e9:.3f} B parameters, {args.layers} blocks, medians of steps 2-{args.steps}")
    for mode, r in results.items():
        med = r["median_s"]
        r["over_plain"] = {k: med[k] / plain[k] for k in med}
        cpu_med, plain_cpu = r["median_cpu_s"], results["plain"]["median_cpu_s"]
        r["cpu_over_plain"] = {k: cpu_med[k] / plain_cpu[k] for k in cpu_med}
        print(f"{mode:>22}: " + ", ".join(f"{k} {med[k]:.2f} s ({r['over_plain'][k]:.2f}x)" for k in med)
              + "; CPU time: " + ", ".join(f"{k} {r['cpu_over_plain'][k]:.2f}x" for k in cpu_med))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"layers": args.layers, "d_model": args.d_model, "load_average": os.getloadavg(),
                       "runs": results}, f, indent=1)


if __name__ == "__main__":
    main()
