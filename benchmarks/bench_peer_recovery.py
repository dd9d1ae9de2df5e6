"""The memory tier's figures (issue 45), 2 gloo ranks on loopback, one session:

- per-step overhead of ``memory_checkpoint`` at ``--every`` (default ``auto``: the tier commits
  every step while that costs <= 5% of a step, else every K-th, Note [commit pacing]; the copy
  into the mapped slot, the crc, stamps and replica swap on the tier's thread; the next step
  waits for the copy only) on the step time: the summed time of alternating blocks of steps
  with and without it (sums, not medians of blocks: a block of K-step cycles may hold 0 or 1
  commit), after a warm-up with the tier that lets "auto" measure and choose K (goal <= 5%);
  the K chosen and the cost the tier measured (``MemoryTier.report()``, rank 0);
- disk bytes a recovery opens (files under the disk checkpoint, counted by an audit hook);
- the load part of recovery: ``load_checkpoint`` from the memory tiers vs from the disk
  checkpoint of the same step (both just written: the disk's pages are in the page cache, the
  best case for the disk), same model, same processes; and the disk bytes each read. The
  restart itself (torchrun starting workers, the process group) is the same for both and
  left out.

    python benchmarks/bench_peer_recovery.py [--hidden 2048 --layers 4 --blocks 5 --steps 16 --every auto]
        [--world 4 --parity 4]   (XOR parity over groups of 4 instead of a replica: parity_over_shard_bytes)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid

import torch
import torch.distributed as dist

import zeroshard
from zeroshard.checkpoint.memory_commit import commit_step
from zeroshard.testing.launch import spawn


def _model(hidden: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden) for _ in range(layers)])


def _step(model: torch.nn.Module, opt: zeroshard.ZeroOptimizer, x: torch.Tensor) -> None:
    opt.backward(model(x).square().mean())
    opt.step()
    opt.zero_grad()


def _rank(rank: int, world: int, a: argparse.Namespace, tier: str, disk: str, out: str) -> None:
    model = _model(a.hidden, a.layers)
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-3, stage=2,
                                  redundancy=zeroshard.PeerRedundancy(path=tier, run_id="bench", every=a.every,
                                                                      parity=a.parity or None))
    x = torch.randn(a.batch, a.hidden)
    root = os.path.realpath(disk) + os.sep
    opened: list[str] = []  # files under the disk checkpoint this process opens (Python's audit events)
    sys.addaudithook(lambda event, args: opened.append(os.fsdecode(args[0])) if event == "open" and args and isinstance(
        args[0], (str, bytes)) and os.path.realpath(os.fsdecode(args[0])).startswith(root) else None)
    step, plain, tiered = 0, [], []
    for _ in range(2):  # warm-up
        _step(model, opt, x)
        step += 1
    tier_step = 0  # the steps of the run with the tier: its blocks, back to back (the tier's clock)
    for _ in range(a.warmup):  # with the tier: "auto" probes, measures and agrees on K here
        _step(model, opt, x)
        step += 1
        tier_step += 1
        zeroshard.memory_checkpoint(tier_step, model=model, optimizer=opt)
    opt.engine.memory_tier.wait()
    commits = 0
    for _ in range(a.blocks):
        for with_tier in (False, True):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(a.steps):
                _step(model, opt, x)
                step += 1
                if with_tier:
                    tier_step += 1
                    commits += zeroshard.memory_checkpoint(tier_step, model=model, optimizer=opt)
            if with_tier:
                opt.engine.memory_tier.wait()  # (the block pays for its last background write too)
                if opt.engine.memory_tier.pacer is not None:  # (the block without it is no step of its clock)
                    opt.engine.memory_tier.pacer.pause()
            dist.barrier()
            (tiered if with_tier else plain).append((time.perf_counter() - t0) / a.steps)
    report = opt.engine.memory_tier.report()
    zeroshard.save_checkpoint(disk, step, model=model, optimizer=opt)
    commit_step(step, force=True, model=model, optimizer=opt)  # (this step whatever K is, as a handoff's)
    opt.engine.memory_tier.wait()
    state_bytes = opt.memory_report().master_weights + opt.memory_report().optimizer_states + \
        opt.memory_report().parameters
    tier_bytes = opt.memory_report().memory_tier
    opt.close()
    loads = {}
    for source in ("memory", "disk", "memory", "disk"):
        m = _model(a.hidden, a.layers)
        o = zeroshard.ZeroOptimizer(m, torch.optim.AdamW, lr=1e-3, stage=2, redundancy=zeroshard.PeerRedundancy(
            path=tier if source == "memory" else tier + "-none", run_id="bench", parity=a.parity or None))
        dist.barrier()
        opened.clear()
        t0 = time.perf_counter()
        info = zeroshard.load_checkpoint(disk, model=m, optimizer=o)
        _step(m, o, x)  # the next completed step
        dist.barrier()
        read = sum(os.path.getsize(p) for p in set(opened) if os.path.isfile(p))
        loads.setdefault(source, []).append((time.perf_counter() - t0, read, info.get("source")))
        o.close()
    if rank == 0:
        figures = {
            "step_s_plain": statistics.median(plain), "step_s_with_tier": statistics.median(tiered),
            "tier_overhead": sum(tiered) / sum(plain) - 1,
            "tier_overhead_median_blocks": statistics.median(tiered) / statistics.median(plain) - 1,
            "every": report["every"], "commits_in_measured_steps": commits,
            "measured_steps": a.blocks * a.steps, "tier_commit_cost": report["commit_cost"],
            "tier_step_cost": report["step_cost"],
            "load_and_step_s_memory": min(t for t, _, _ in loads["memory"]),
            "load_and_step_s_disk": min(t for t, _, _ in loads["disk"]),
            "disk_bytes_opened_memory": loads["memory"][0][1], "disk_bytes_opened_disk": loads["disk"][0][1],
            "sources": [s for _, _, s in loads["memory"]],
            "owned_state_bytes_rank0": state_bytes, "memory_report_tier_bytes_rank0": tier_bytes,
            "params": sum(p.numel() for p in _model(a.hidden, a.layers).parameters()),
            "world": world, "parity": a.parity or None,
            # (both slots of each: the own slots' data and the parity slots' data, Note [parity memory tier])
            "parity_over_shard_bytes": report["parity_bytes"] / max(report["shard_bytes"], 1),
        }
        figures["memory_vs_disk"] = figures["load_and_step_s_memory"] / figures["load_and_step_s_disk"]
        with open(out, "w") as f:
            json.dump(figures, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=5)
    ap.add_argument("--steps", type=int, default=16, help="steps per block")
    ap.add_argument("--warmup", type=int, default=16, help="steps with the tier before the measured blocks")
    ap.add_argument("--every", default="auto", type=lambda v: v if v == "auto" else int(v),
                    help="PeerRedundancy(every=): auto (the default) or K")
    ap.add_argument("--batch", type=int, default=8, help="rows per rank and step (compute per step vs state)")
    ap.add_argument("--world", type=int, default=2, help="gloo ranks")
    ap.add_argument("--parity", type=int, default=0, help="PeerRedundancy(parity=g): XOR parity over groups of g "
                    "ranks instead of a replica (0: a replica)")
    a = ap.parse_args()
    tier = f"/dev/shm/zeroshard-bench-{uuid.uuid4().hex[:8]}"
    work = tempfile.mkdtemp(prefix="zs-peer-bench-")
    try:
        out = os.path.join(work, "figures.json")
        spawn(_rank, a.world, a, tier, os.path.join(work, "ckpt"), out)
        with open(out) as f:
            print(json.dumps(json.load(f), indent=1))
    finally:
        shutil.rmtree(tier, ignore_errors=True)
        shutil.rmtree(tier + "-none", ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
