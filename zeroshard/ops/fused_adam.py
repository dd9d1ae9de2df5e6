"""``FusedAdam``: a drop-in for torch.optim.AdamW (and Adam with ``adamw_mode=False``).

State and param-group keys mirror torch's (``step`` as a float32 scalar tensor, ``exp_avg``,
``exp_avg_sq``; ``lr``, ``betas``, ``eps``, ``weight_decay``, ``amsgrad``, ``maximize``,
``decoupled_weight_decay``, ...), so state dicts move between FusedAdam and torch.optim.AdamW
in both directions and LR schedulers work unchanged. ``adamw_mode`` is the one extra key.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from typing import Any

import torch
from torch import Tensor

from ._functional import adam_step_multi_


def _as_float(value: float | Tensor, name: str) -> float:
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a scalar, got a tensor of shape {tuple(value.shape)}")
        return float(value.item())
    return float(value)


class FusedAdam(torch.optim.Optimizer):
    """Adam/AdamW whose step runs the fused CPU (AVX-512/AVX2) or CUDA multi-tensor kernel.

    Args:
        params: parameters or param-group dicts, as for any torch.optim optimizer.
        lr: learning rate (float or scalar tensor; schedulers may change it per group).
        betas: coefficients of the running averages of the gradient and its square.
        eps: added to the denominator for numerical stability.
        weight_decay: decoupled decay (AdamW) or L2 penalty (Adam), see ``adamw_mode``.
        adamw_mode: True for AdamW (``p *= 1 - lr * wd``), False for Adam (``g += wd * p``).
        maximize: maximise the objective instead of minimising it.
        amsgrad: accepted for signature compatibility; only False is supported.
    """

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]], lr: float | Tensor = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, adamw_mode: bool = True, *, amsgrad: bool = False,
                 maximize: bool = False) -> None:
        lr_value = _as_float(lr, "lr")
        if not lr_value >= 0.0:
            raise ValueError(f"Invalid learning rate: {lr!r} (must be >= 0)")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps!r} (must be >= 0)")
        if len(betas) != 2 or not all(0.0 <= float(b) < 1.0 for b in betas):
            raise ValueError(f"Invalid betas: {betas!r} (need two values in [0, 1))")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay!r} (must be >= 0)")
        if amsgrad:
            raise ValueError("FusedAdam does not implement amsgrad=True; use torch.optim.AdamW(amsgrad=True)")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False,
                        maximize=maximize, foreach=None, capturable=False, differentiable=False,
                        fused=None, decoupled_weight_decay=bool(adamw_mode), adamw_mode=bool(adamw_mode))
        super().__init__(params, defaults)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Also the path of load_state_dict: groups saved by torch.optim.AdamW/Adam carry
        # decoupled_weight_decay but no adamw_mode, and old states may hold a float step.
        super().__setstate__(state)
        for group in self.param_groups:
            mode = group.get("adamw_mode", group.get("decoupled_weight_decay", self.defaults["adamw_mode"]))
            group["adamw_mode"] = bool(mode)
            group["decoupled_weight_decay"] = bool(mode)
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            for p in group["params"]:
                st = self.state.get(p, {})
                if "step" in st and not torch.is_tensor(st["step"]):
                    st["step"] = torch.tensor(float(st["step"]), dtype=torch.float32)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None, *,  # type: ignore[override]
             grad_scale: float = 1.0, copy_out: dict[int, Tensor] | None = None,
             only: Collection[int] | None = None) -> float | None:
        """One step. ``grad_scale`` multiplies every gradient inside the kernel (e.g. loss-scale
        unscale x clip coefficient), which saves the separate in-place sweep over the gradients
        that unscaling or ``clip_grad_norm_`` would otherwise make; gradients are not modified.
        ``copy_out`` maps ``id(param)`` to a bf16/fp16 tensor of the same size that receives the
        updated parameter in the same pass (the low-precision model copy of an fp32 master).
        ``only`` restricts the step to the parameters with these ids (a caller that updates
        its parameters in portions, e.g. unit by unit, to overlap each with a transfer)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group, grad_scale, copy_out or {}, only)
        return loss

    def _step_group(self, group: dict[str, Any], grad_scale: float, copy_out: dict[int, Tensor],
                    only: Collection[int] | None = None) -> None:
        if group.get("amsgrad", False):
            raise ValueError("FusedAdam does not implement amsgrad=True (param group has amsgrad=True)")
        beta1, beta2 = (_as_float(b, "betas") for b in group["betas"])
        # Parameters of one group normally share their step count; grouping by it keeps the
        # result exact if some were skipped (grad None) on earlier steps.
        by_step: dict[int, tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor], list]] = {}
        for p in group["params"]:
            if p.grad is None or (only is not None and id(p) not in only):
                continue
            if p.grad.is_sparse:
                raise RuntimeError(f"FusedAdam does not support sparse gradients ({p.shape=})")
            state = self.state[p]
            if len(state) == 0:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            lists = by_step.setdefault(int(state["step"].item()), ([], [], [], [], []))
            for lst, t in zip(lists, (p, p.grad, state["exp_avg"], state["exp_avg_sq"], copy_out.get(id(p)))):
                lst.append(t)
        for step, (ps, gs, ms, vs, outs) in by_step.items():
            adam_step_multi_(ps, gs, ms, vs, step=step, lr=_as_float(group["lr"], "lr"), beta1=beta1,
                             beta2=beta2, eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                             adamw_mode=group["adamw_mode"],
                             grad_scale=-grad_scale if group["maximize"] else grad_scale,
                             out_lowps=outs if any(o is not None for o in outs) else None)
