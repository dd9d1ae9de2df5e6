"""The global gradient norm ``ZeroOptimizer.clip_grad_norm_`` clips by.

Each rank holds the averaged gradient of its owned ranges (stages 1-2; all of it at stage 0),
so the norm is a local partial sum, reduced over the data-parallel group when state is
sharded. With tensor parallelism (Note [tensor-parallel parameters] in
``zeroshard/comm/tensor_parallel.py``) the partial sums are also summed over the tp group,
each element counted once: TP-sharded pieces on every tp rank, replicated ones on tp rank 0.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from ..ops.sqnorm import squared_norm_f64


def _tp_parts(opt: Any, fn: Any) -> list[torch.Tensor]:
    out = []
    for u in opt.units:
        if not u.grad_valid:
            continue
        g = u.owned_grad()
        ranges = opt.tp.counted_ranges(u)
        if ranges is None:
            out.append(fn(g))
        else:
            out += [fn(g[a:b]) for a, b in ranges]
    return out


def global_norm(opt: Any, norm_type: float) -> torch.Tensor:
    """The norm of order ``norm_type`` of all gradients of all ranks (a collective)."""
    device = opt.units[0].grad_store.device if opt.units else torch.device("cpu")
    tp = opt.tp
    if norm_type == math.inf:  # (a maximum: counting a replicated element twice changes nothing)
        parts = opt._map_owned_grads(lambda g: g.abs().max())
        total = torch.stack(parts).max().clone() if parts else torch.zeros((), device=device)
        if opt.policy.shard_optimizer:
            opt.comm.all_reduce(total.view(1), op=dist.ReduceOp.MAX, what="norm")
        if tp is not None:
            tp.comm.all_reduce(total.view(1), op=dist.ReduceOp.MAX, what="norm")
        return total

    def power(g: torch.Tensor) -> torch.Tensor:
        if norm_type == 2.0:  # (the same function as FlatUnit.note_grad_stats: same bits)
            return squared_norm_f64(g)
        return torch.linalg.vector_norm(g, norm_type, dtype=torch.float64) ** norm_type
    parts = (_tp_parts(opt, power) if tp is not None else
             opt._map_owned_grads(power, cached=(lambda s: s["sqnorm"]) if norm_type == 2.0 else None))
    local = torch.stack(parts).sum() if parts else torch.zeros((), dtype=torch.float64, device=device)
    if opt.policy.shard_optimizer:
        opt.comm.all_reduce(local.view(1), what="norm")
    if tp is not None:
        tp.comm.all_reduce(local.view(1), what="norm")
    return (local ** (1.0 / norm_type)).to(opt.units[0].master.dtype if opt.units else torch.float32)
