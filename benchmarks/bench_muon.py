"""Muon's optimizer step under ZeroOptimizer against one process and against DeepSpeed's approach.

    python benchmarks/bench_muon.py --hidden 256 --layers 4 --world-size 2 --steps 6

Same Llama (transformers, from a small config), same run, medians of steps 2..N of the
optimizer step alone (forward and backward are the same in every mode):
- "torch, one process": ``torch.optim.Muon`` on the hidden matrices + ``AdamW`` on the rest;
- "zeroshard": ``ZeroOptimizer`` stage 2 with that recipe: each matrix updated once, by its
  owner rank (Note [whole-tensor units] in zeroshard/layout/bucketing.py), then the usual
  parameter all-gather;
- "DeepSpeed's approach": every rank all-gathers every matrix's gradient from the
  reduce-scattered partitions, orthogonalises every matrix (torch.optim.Muon on all of them),
  then the same parameter all-gather.
Printed as ratios to the one-process step. Also the bytes each rank sends (ring collectives:
(N-1)/N of the tensor; from ``comm_report``): in backward and step together against the same
model on AdamW alone (the whole-tensor path's extra traffic is the owner layout's padding),
and in the optimizer step (the parameter all-gather) against the rank's share of the
parameters' bytes; and the owners' balance of Newton-Schulz flops. Timings are noisy on a shared 2-core machine: read the ratios of one run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def llama(hidden: int, layers: int) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=hidden * 2,
                                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=64, tie_word_embeddings=False))


def is_matrix(name: str, p: Any) -> bool:
    return p.ndim == 2 and ".layers." in name


def batch(step: int) -> Any:
    import torch
    return torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(step))


def _median_steps(times: list[float]) -> float:
    return statistics.median(times[1:] if len(times) > 1 else times)


def one_process(args: argparse.Namespace) -> float:
    import torch
    model = llama(args.hidden, args.layers)
    named = list(model.named_parameters())
    opts = [torch.optim.Muon([p for n, p in named if is_matrix(n, p)], lr=0.02),
            torch.optim.AdamW([p for n, p in named if not is_matrix(n, p)], lr=3e-3)]
    times = []
    for step in range(args.steps):
        ids = batch(step)
        model(input_ids=ids, labels=ids).loss.backward()
        t = time.perf_counter()
        for o in opts:
            o.step()
            o.zero_grad()
        times.append(time.perf_counter() - t)
    return _median_steps(times)


def _sent(report: dict, world: int) -> int:
    """Bytes this rank sent: ring collectives send (N-1)/N of the tensor; control reductions skipped."""
    return int(sum(v["bytes"] for k, v in report.items() if k in ("reduce_scatter", "all_gather", "all_reduce"))
               * (world - 1) / world)


def rank_main(rank: int, world: int, out: str, args: argparse.Namespace) -> None:
    import torch
    import zeroshard
    from zeroshard.comm.collective_names import all_gather_single, reduce_scatter_single
    from zeroshard.layout.bucketing import update_cost
    res: dict[str, Any] = {}
    for mode in ("zeroshard", "adamw"):
        model = llama(args.hidden, args.layers)
        named = list(model.named_parameters())
        groups = [{"params": [p for n, p in named if is_matrix(n, p)], "optimizer_class": torch.optim.Muon,
                   "lr": 0.02}, {"params": [p for n, p in named if not is_matrix(n, p)], "lr": 3e-3}]
        opt = zeroshard.ZeroOptimizer(groups if mode == "zeroshard" else model, torch.optim.AdamW, stage=2,
                                      module=model)
        times, sent = [], []
        for step in range(args.steps):
            ids = batch(step * world + rank)
            opt.comm_report(reset=True)
            model(input_ids=ids, labels=ids).loss.backward()
            backward = _sent(opt.comm_report(reset=True), world)
            t = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t)
            sent.append((backward, _sent(opt.comm_report(), world)))
            opt.zero_grad()
        res[mode] = {"step": _median_steps(times), "sent": statistics.median(a + b for a, b in sent),
                     "sent_in_step": statistics.median(b for _, b in sent)}
        if mode == "zeroshard":
            loads = [0.0] * world
            for u in opt.units:
                for seg in u.layout.segments:
                    if len(seg.shape) == 2 and ".layers." in seg.name:
                        loads[seg.offset // u.layout.shard_numel] += update_cost(seg.shape)
            res["ns_flops_per_rank"] = loads
            res["param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
        opt.close()
    # DeepSpeed's approach: gradients reduce-scattered into flat partitions (as its stage 2),
    # then every matrix's gradient all-gathered and every matrix orthogonalised on every rank.
    model = llama(args.hidden, args.layers)
    named = list(model.named_parameters())
    mats = [p for n, p in named if is_matrix(n, p)]
    opts = [torch.optim.Muon(mats, lr=0.02), torch.optim.AdamW([p for n, p in named if not is_matrix(n, p)], lr=3e-3)]
    flat_numel = sum(p.numel() for p in model.parameters())
    padded = -(-flat_numel // world) * world
    times = []
    for step in range(args.steps):
        ids = batch(step * world + rank)
        model(input_ids=ids, labels=ids).loss.backward()
        flat = torch.zeros(padded)
        torch.cat([p.grad.reshape(-1) for p in model.parameters()], out=flat[:flat_numel])
        part = torch.empty(padded // world)
        reduce_scatter_single(part, flat)  # (as its stage 2 does in backward: not timed)
        t = time.perf_counter()
        full = torch.empty(padded)
        all_gather_single(full, part)  # every matrix's gradient, on every rank
        offset = 0
        for p in model.parameters():
            p.grad.copy_(full[offset:offset + p.numel()].view_as(p)).div_(world)
            offset += p.numel()
        for o in opts:
            o.step()  # every matrix orthogonalised on every rank
            o.zero_grad()
        params = torch.cat([p.detach().reshape(-1) for p in model.parameters()] + [torch.zeros(padded - flat_numel)])
        gathered = torch.empty(padded)
        all_gather_single(gathered, params[rank * (padded // world):(rank + 1) * (padded // world)])
        times.append(time.perf_counter() - t)
    res["deepspeed"] = {"step": _median_steps(times)}
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump(res, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args()
    from zeroshard.testing.launch import spawn
    single = one_process(args)
    out = os.path.join(tempfile.mkdtemp(), "res")
    spawn(rank_main, args.world_size, out, args)
    ranks = [json.load(open(f"{out}.rank{r}")) for r in range(args.world_size)]
    world = args.world_size
    zs = max(r["zeroshard"]["step"] for r in ranks)
    ds = max(r["deepspeed"]["step"] for r in ranks)
    loads = ranks[0]["ns_flops_per_rank"]
    share = ranks[0]["param_bytes"] / world
    figures = {
        "world": world, "hidden": args.hidden, "layers": args.layers,
        "zeroshard_step_over_one_process": zs / single, "deepspeed_approach_over_one_process": ds / single,
        "zeroshard_over_deepspeed_approach": zs / ds,
        "ns_flops_max_over_min": max(loads) / max(1.0, min(loads)),
        "bytes_sent_whole_over_adamw": max(r["zeroshard"]["sent"] / r["adamw"]["sent"] for r in ranks),
        "bytes_sent_in_optimizer_step_over_share": max(r["zeroshard"]["sent_in_step"] for r in ranks) / share,
        "extra_bytes_over_share": max(r["zeroshard"]["sent"] - r["adamw"]["sent"] for r in ranks) / share,
    }
    for k, v in figures.items():
        print(f"{k:40s} {v:.3f}" if isinstance(v, float) else f"{k:40s} {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
