"""``ZeroOptimizer.clip_grad_norm_``: the true global norm of gradients sharded across ranks.

With Adam/AdamW on the fused kernel the coefficient is applied inside the optimizer pass
rather than by rewriting the gradients (one sweep less); a second call before ``step``
therefore sees the unclipped gradients again and sets the same coefficient.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist


def clip_grad_norm(opt: Any, max_norm: float, norm_type: float = 2.0,
                   error_if_nonfinite: bool = False) -> torch.Tensor:
    norm_type = float(norm_type)
    overflow = opt._finalize_grads()
    device = opt.units[0].grad_store.device if opt.units else torch.device("cpu")
    if norm_type == math.inf:
        parts = opt._map_owned_grads(lambda g: g.abs().max())
        local = torch.stack(parts).max() if parts else torch.zeros((), device=device)
        total = local.clone()
        if opt.policy.shard_optimizer:
            opt.comm.all_reduce(total.view(1), op=dist.ReduceOp.MAX, what="norm")
    else:
        parts = opt._map_owned_grads(lambda g: torch.linalg.vector_norm(g, norm_type, dtype=torch.float64)
                                      ** norm_type,
                                      cached=(lambda s: s["sqnorm"]) if norm_type == 2.0 else None)
        local = torch.stack(parts).sum() if parts else torch.zeros((), dtype=torch.float64, device=device)
        if opt.policy.shard_optimizer:
            opt.comm.all_reduce(local.view(1), what="norm")
        total = (local ** (1.0 / norm_type)).to(opt.units[0].master.dtype if opt.units else torch.float32)
    if not torch.isfinite(total):
        if error_if_nonfinite and not overflow:
            raise RuntimeError(f"the total norm of order {norm_type} of the gradients is {total.item()}")
        return total
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if opt._fused_step:  # applied inside the fused Adam pass: no extra sweep over gradients
        opt._clip_coef = float(coef)
    else:  # (swapped gradients imply the fused kernel: offload_optimizer="nvme")
        for g in opt._owned_grads():
            g.mul_(coef)
    return total
