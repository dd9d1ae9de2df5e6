"""``ZeroOptimizer.clip_grad_norm_``: the true global norm of gradients sharded across ranks.

With Adam/AdamW on the fused kernel the coefficient is applied inside the optimizer pass
rather than by rewriting the gradients (one sweep less); a second call before ``step``
therefore sees the unclipped gradients again and sets the same coefficient.
"""
from __future__ import annotations

from typing import Any

import torch

from zeroshard.optim import grad_norm


def clip_grad_norm(opt: Any, max_norm: float, norm_type: float = 2.0,
                   error_if_nonfinite: bool = False) -> torch.Tensor:
    norm_type = float(norm_type)
    overflow = opt._finalize_grads()
    total = grad_norm.global_norm(opt, norm_type)  # (tensor parallelism: each element counted once)
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
