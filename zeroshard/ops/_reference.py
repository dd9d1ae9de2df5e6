"""The pure-PyTorch Adam/AdamW step: the fallback, and the definition the kernels must match.

It is torch.optim.AdamW's / torch.optim.Adam's single-tensor step (amsgrad=False,
maximize=False) written operation for operation, plus the two fused extras: the gradient is
multiplied by ``grad_scale`` first, and the updated parameter is copied to ``out_lowp``.
"""
from __future__ import annotations

import torch
from torch import Tensor


def reference_adam_step_(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, *,
                         step: int, lr: float, beta1: float, beta2: float, eps: float,
                         weight_decay: float, adamw_mode: bool, grad_scale: float = 1.0,
                         out_lowp: Tensor | None = None) -> None:
    """One step in place; ``param``'s dtype is the compute dtype, as in torch.optim."""
    with torch.no_grad():
        g = grad.to(param.dtype) if grad.dtype != param.dtype else grad
        if grad_scale != 1.0:
            g = g * grad_scale  # a new tensor: the caller's gradient is left untouched
        if adamw_mode:
            param.mul_(1 - lr * weight_decay)
        elif weight_decay != 0:
            g = g.add(param, alpha=weight_decay)
        exp_avg.lerp_(g, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        step_size = lr / (1 - beta1**step)
        bias_correction2_sqrt = (1 - beta2**step) ** 0.5
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        param.addcdiv_(exp_avg, denom, value=-step_size)
        if out_lowp is not None:
            out_lowp.copy_(param)
