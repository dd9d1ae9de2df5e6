"""An elementwise optimizer that keeps values in its param groups, written like Prodigy and
D-Adaptation: ``step`` updates ``group["d"]`` (an estimate of the distance to the solution,
from sums over the group's gradients and updates) and adds keys of its own (``k``, the
step count, and ``d_numerator``). Used by tests/unit/test_optim_corners.py."""
from __future__ import annotations

import torch


class DistanceAdapted(torch.optim.Optimizer):
    zeroshard_elementwise = True  # (exact at one rank: d sums over the group, as Prodigy does)

    def __init__(self, params, lr: float = 1.0, d0: float = 1e-3, beta: float = 0.9, eps: float = 1e-8,
                 growth: float = 2.0) -> None:
        super().__init__(params, dict(lr=lr, d=d0, beta=beta, eps=eps, growth=growth))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            d, lr, beta, eps = group["d"], group["lr"], group["beta"], group["eps"]
            numerator = group.get("d_numerator", 0.0)
            denominator = 0.0
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["s"] = torch.zeros_like(p)
                    state["v"] = torch.zeros_like(p)
                g = p.grad
                state["v"].mul_(beta).addcmul_(g, g, value=1 - beta)
                state["s"].add_(g, alpha=d * lr)
                numerator += d * lr * float((g * state["s"]).sum())  # (sums over elements: any split adds up)
                denominator += float(state["s"].abs().sum())
            group["d_numerator"] = numerator
            if denominator > 0:
                group["d"] = max(d, min(d * group["growth"], abs(numerator) / denominator + d))
            group["k"] = group.get("k", 0) + 1
            for p in group["params"]:
                if p.grad is None:
                    continue
                v = self.state[p]["v"]
                p.addcdiv_(p.grad, v.sqrt().add_(eps), value=-group["d"] * lr)
        return loss
