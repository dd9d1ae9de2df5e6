"""Step time and per-rank model-state memory: zeroshard stages vs its peers, one session.

    python benchmarks/bench_step.py [--rounds 3 --steps 4 --world-size 2]

Ratios are step time / single-process ``torch.optim.AdamW(fused=True)`` on the same model
and global batch (2 threads), measured in interleaved rounds (every configuration once per
round, medians over all rounds) so machine noise hits all of them alike. Peers: DDP +
AdamW, DDP + ``ZeroRedundancyOptimizer`` (torch's ZeRO-1), FSDP2 ``fully_shard`` per block;
DeepSpeed when it is installed. Memory is tensor accounting of what each rank holds
(parameters, gradients, optimizer state, fp32 master) after a step.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from zeroshard.launch import spawn
from zeroshard.toy import GPTConfig, TinyGPT, synthetic_batch

MODEL = GPTConfig(vocab=256, d_model=768, n_layers=7, n_heads=12, seq_len=64)
GLOBAL_BATCH = 8


def _unique_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        if t.numel() == 0:
            continue
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def _state_tensors(opt) -> list:
    return [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def _build(kind: str, model: torch.nn.Module):
    """Returns (module to call, optimizer, memory function)."""
    if kind == "single":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        return model, opt, lambda: _unique_bytes(list(model.parameters()) + [p.grad for p in model.parameters()] + _state_tensors(opt))
    if kind.startswith("zeroshard"):
        import zeroshard
        opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-4, stage=int(kind[-1]))
        return model, opt, lambda: opt.memory_report().model_states
    if kind in ("ddp", "ddp_zero1"):
        from torch.nn.parallel import DistributedDataParallel as DDP
        ddp = DDP(model, gradient_as_bucket_view=True)
        if kind == "ddp":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
            state = lambda: _state_tensors(opt)  # noqa: E731
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer
            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4, fused=True)
            state = lambda: _state_tensors(opt.optim)  # noqa: E731
        return ddp, opt, lambda: _unique_bytes(list(model.parameters()) + [p.grad for p in model.parameters()] + state())
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=False)  # ZeRO-2-like: params stay gathered
        fully_shard(model, reshard_after_forward=False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        return model, opt, lambda: _unique_bytes(list(model.parameters()) + [p.grad for p in model.parameters()] + _state_tensors(opt))
    raise ValueError(f"unknown configuration {kind!r}")


def _worker(rank: int, world: int, kind: str, steps: int, out: str) -> None:
    torch.manual_seed(0)
    model = TinyGPT(MODEL)
    module, opt, memory = _build(kind, model)
    local = GLOBAL_BATCH // world
    times = []
    for step in range(steps + 1):  # step 0 warms up
        x, y = synthetic_batch(step, GLOBAL_BATCH, MODEL)
        x, y = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        module(x, y).backward()
        opt.step()
        if step == steps:  # what a rank holds at its peak: gradients still alive
            mem = memory()
        opt.zero_grad(set_to_none=True)
        if world > 1:
            dist.barrier()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"times": times[1:], "memory": mem}, f)


def _run_single(kind: str, steps: int, out: str) -> None:
    torch.set_num_threads(os.cpu_count() or 1)
    _worker(0, 1, kind, steps, out)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--configs", default="single,zeroshard_stage1,zeroshard_stage2,ddp,ddp_zero1,fsdp2")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)
    kinds = a.configs.split(",")
    times: dict[str, list[float]] = {k: [] for k in kinds}
    memory: dict[str, int] = {}
    failures: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(a.rounds):
            for kind in kinds:
                if kind in failures:
                    continue
                out = os.path.join(tmp, f"{kind}.json")
                try:
                    if kind == "single":
                        _run_single(kind, a.steps, out)
                    else:
                        spawn(_worker, a.world_size, kind, a.steps, out)
                except Exception as exc:  # a peer that cannot run here is reported, not fatal
                    failures[kind] = str(exc).strip().splitlines()[-1][:200]
                    continue
                r = json.load(open(out))
                times[kind] += r["times"]
                memory[kind] = r["memory"]
                print(f"round {rnd} {kind}: median {statistics.median(r['times']):.3f}s", file=sys.stderr)
    n = sum(p.numel() for p in TinyGPT(MODEL).parameters())
    base = statistics.median(times["single"]) if times.get("single") else float("nan")
    rows = []
    print(f"\nmodel: {n / 1e6:.1f}M params ({MODEL.n_layers} layers, d={MODEL.d_model}), global batch "
          f"{GLOBAL_BATCH}x{MODEL.seq_len} tokens, world size {a.world_size} (gloo), {os.cpu_count()} cores\n")
    print("| configuration | step time (s) | ÷ single AdamW(fused) | model-state MiB/rank |")
    print("|---|---|---|---|")
    for kind in kinds:
        if kind in failures:
            print(f"| {kind} | could not run: {failures[kind]} | | |")
            continue
        med = statistics.median(times[kind])
        rows.append({"config": kind, "step_s": med, "ratio": med / base, "memory_bytes": memory[kind]})
        print(f"| {kind} | {med:.3f} | {med / base:.2f}x | {memory[kind] / 2**20:.1f} |")
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        print("\nDeepSpeed: not installed (pip install deepspeed); not measured in this run.")
    result = {"params": n, "world_size": a.world_size, "rows": rows, "failures": failures}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
