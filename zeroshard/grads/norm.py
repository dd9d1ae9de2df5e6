"""The global gradient norm ``ZeroOptimizer.clip_grad_norm_`` clips by.

Each rank holds the averaged gradient of its owned ranges (stages 1-2; all of it at stage 0),
so the norm is a local partial sum, reduced over the data-parallel group when state is
sharded, and over the pipeline stages (Note [pipeline parallelism]). With tensor parallelism (Note [tensor-parallel parameters] in
``zeroshard/comm/tensor_parallel.py``) the partial sums are also summed over the tp group,
each element counted once: TP-sharded pieces on every tp rank, replicated ones on tp rank 0.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..ops.sqnorm import squared_norm_f64

if TYPE_CHECKING:
    from zeroshard.comm.process_group import Comm
    from zeroshard.comm.tensor_parallel import TensorParallel
    from zeroshard.units.flat_unit import FlatUnit
    from zeroshard.units.stage_policy import StagePolicy


def map_owned_grads(units: Sequence[FlatUnit], fn: Callable[[torch.Tensor], Any],
                    cached: Optional[Callable[[dict], Any]] = None) -> list[Any]:
    """``fn`` of each owned gradient, reading swapped ones back one unit at a time unless
    ``cached`` computes the same value from the unit's ``grad_stats``."""
    out = []
    for u in units:
        if not u.grad_valid:
            continue
        swap = u.swap_holding("grad")
        if swap is None:
            out.append(fn(u.owned_grad()))
        elif cached is not None and u.grad_stats is not None:
            out.append(cached(u.grad_stats))
        else:
            with swap.resident(u, ("grad",)):
                out.append(fn(u.owned_grad()))
    return out


def _tp_parts(units: Sequence[FlatUnit], tp: TensorParallel, fn: Callable[[torch.Tensor], torch.Tensor]
              ) -> list[torch.Tensor]:
    out = []
    for u in units:
        if not u.grad_valid:
            continue
        g = u.owned_grad()
        ranges = tp.counted_ranges(u)
        if ranges is None:
            out.append(fn(g))
        else:
            out += [fn(g[a:b]) for a, b in ranges]
    return out


def global_norm(units: Sequence[FlatUnit], tp: Optional[TensorParallel], policy: StagePolicy, comm: Comm,
                norm_type: float, pp: Optional[Comm] = None) -> torch.Tensor:
    """The norm of order ``norm_type`` of all gradients of all ranks (a collective): ``units``
    are this rank's, ``comm`` its shard group (summed over when ``policy`` shards the state),
    ``pp`` the other pipeline stages' ranks (Note [pipeline parallelism])."""
    device = units[0].grad_store.device if units else torch.device("cpu")
    if norm_type == math.inf:  # (a maximum: counting a replicated element twice changes nothing)
        parts = map_owned_grads(units, lambda g: g.abs().max())
        total = torch.stack(parts).max().clone() if parts else torch.zeros((), device=device)
        if policy.shard_optimizer:
            comm.all_reduce(total.view(1), op=dist.ReduceOp.MAX, what="norm")
        if tp is not None:
            tp.comm.all_reduce(total.view(1), op=dist.ReduceOp.MAX, what="norm")
        if pp is not None:
            pp.all_reduce(total.view(1), op=dist.ReduceOp.MAX, what="norm")
        return total

    def power(g: torch.Tensor) -> torch.Tensor:
        if norm_type == 2.0:  # (the same function as FlatUnit.note_grad_stats: same bits)
            return squared_norm_f64(g)
        return torch.linalg.vector_norm(g, norm_type, dtype=torch.float64) ** norm_type
    parts = (_tp_parts(units, tp, power) if tp is not None else
             map_owned_grads(units, power, cached=(lambda s: s["sqnorm"]) if norm_type == 2.0 else None))
    local = torch.stack(parts).sum() if parts else torch.zeros((), dtype=torch.float64, device=device)
    if policy.shard_optimizer:
        comm.all_reduce(local.view(1), what="norm")
    if tp is not None:
        tp.comm.all_reduce(local.view(1), what="norm")
    if pp is not None:  # (each stage holds different parameters: their sums add)
        pp.all_reduce(local.view(1), what="norm")
    return (local ** (1.0 / norm_type)).to(units[0].master.dtype if units else torch.float32)
