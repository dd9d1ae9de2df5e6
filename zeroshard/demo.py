"""``python -m zeroshard.demo``: a small transformer trained on 2 gloo ranks at stages 0, 1
and 2, printing each rank's model-state memory and the loss, so the savings are visible.

Every stage starts from the same weights and sees the same global batch, so the loss
columns agree while the memory column shrinks.
"""
from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist

import zeroshard
from zeroshard.launch import spawn
from zeroshard.toy import GPTConfig, TinyGPT, synthetic_batch

CONFIG = GPTConfig(vocab=256, d_model=128, n_layers=4, n_heads=4, seq_len=32)


def _log(rank: int, msg: str) -> None:
    # One line per rank, printed in rank order so the output reads as a table.
    for r in range(dist.get_world_size()):
        if r == rank:
            print(msg, flush=True)
        dist.barrier()


def _train(rank: int, world: int, stage: int, steps: int, global_batch: int) -> None:
    torch.manual_seed(0)
    model = TinyGPT(CONFIG)
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=3e-3, weight_decay=0.1, stage=stage)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    local = global_batch // world
    losses = []
    for step in range(steps):
        x, y = synthetic_batch(step % 4, global_batch, CONFIG)  # 4 batches, revisited: loss falls
        loss = model(x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local])
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    rep = opt.memory_report()
    _log(rank, f"stage {stage} rank {rank}: {rep} | model states {rep.model_states / 2**20:6.2f} MiB"
               + (f" | loss {losses[0]:.3f} -> {losses[-1]:.3f}" if rank == 0 else ""))


def _main(rank: int, world: int, steps: int, global_batch: int) -> None:
    if rank == 0:
        n = sum(p.numel() for p in TinyGPT(CONFIG).parameters())
        print(f"TinyGPT {n / 1e6:.2f}M parameters, {world} gloo ranks, global batch {global_batch}, "
              f"AdamW; ZeRO formulas per rank (fp32): stage 0 16Ψ, stage 1 8Ψ+8Ψ/N, stage 2 4Ψ+12Ψ/N", flush=True)
    for stage in (0, 1, 2):
        _train(rank, world, stage, steps, global_batch)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--global-batch", type=int, default=8)
    a = ap.parse_args(argv)
    if a.global_batch % a.world_size:
        raise SystemExit(f"--global-batch {a.global_batch} must be divisible by --world-size {a.world_size}")
    spawn(_main, a.world_size, a.steps, a.global_batch)


if __name__ == "__main__":
    main()
