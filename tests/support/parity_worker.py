"""Runs inside each rank: zeroshard against single-process torch.optim, many configurations
in one process group; writes per-config results as JSON for the pytest side to assert."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch

import zeroshard
from tests.support.models import TinyNet, batch, param_groups

GLOBAL_BATCH = 8
STEPS = 12
MAX_NORM = 0.5  # small enough that clipping is active on most steps

OPTIMIZERS = {
    "sgd": (torch.optim.SGD, dict(lr=5e-2, momentum=0.9)),
    "adam": (torch.optim.Adam, dict(lr=1e-2)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2)),
    "adagrad": (torch.optim.Adagrad, dict(lr=5e-2)),
    "rmsprop": (torch.optim.RMSprop, dict(lr=1e-3, momentum=0.5)),
}


@dataclass(frozen=True)
class Case:
    stage: int
    optimizer: str
    accumulation: int = 1
    precision: str | None = None

    @property
    def key(self) -> str:
        return f"stage{self.stage}-{self.optimizer}-acc{self.accumulation}-{self.precision or 'fp32'}"


def all_cases() -> list[Case]:
    cases = [Case(s, o) for s in (0, 1, 2) for o in OPTIMIZERS]
    cases += [Case(s, "adamw", accumulation=2) for s in (0, 1, 2)]
    cases += [Case(s, "adamw", precision="bf16") for s in (0, 1, 2)]
    return cases


def _schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))


def _reference(case: Case) -> list[torch.Tensor]:
    """Single process, plain torch.optim, full global batch. Under bf16 it emulates the same
    recipe (bf16 model, fp32 master copies updated by torch.optim)."""
    torch.manual_seed(0)
    model = TinyNet()
    cls, kw = OPTIMIZERS[case.optimizer]
    if case.precision == "bf16":
        masters = [p.detach().clone().requires_grad_(p.requires_grad) for p in model.parameters()]
        model.to(torch.bfloat16)
        groups = param_groups(model)
        lookup = {id(p): m for p, m in zip(model.parameters(), masters)}
        opt = cls([{**g, "params": [lookup[id(p)] for p in g["params"]]} for g in groups], **kw)
    else:
        opt = cls(param_groups(model), **kw)
    sched = _schedule(opt)
    for step in range(STEPS):
        opt.zero_grad()
        model.zero_grad()
        model(batch(step, GLOBAL_BATCH)).backward()
        if case.precision == "bf16":
            for p, m in zip(model.parameters(), masters):
                if p.grad is not None:
                    m.grad = p.grad.float()
            torch.nn.utils.clip_grad_norm_([m for m in masters if m.requires_grad], MAX_NORM)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        sched.step()
        if case.precision == "bf16":
            with torch.no_grad():
                for p, m in zip(model.parameters(), masters):
                    p.copy_(m)
    return [p.detach().float() for p in model.parameters()]


def _zeroshard(case: Case, rank: int, world: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = TinyNet()
    cls, kw = OPTIMIZERS[case.optimizer]
    opt = zeroshard.ZeroOptimizer(param_groups(model, named=True), cls, stage=case.stage,
                                  mixed_precision=case.precision, bucket_size_mb=0.001, **kw)
    sched = _schedule(opt)
    local = GLOBAL_BATCH // world
    micro = local // case.accumulation
    for step in range(STEPS):
        data = batch(step, GLOBAL_BATCH)[rank * local:(rank + 1) * local]
        for k in range(case.accumulation):
            (model(data[k * micro:(k + 1) * micro]) / case.accumulation).backward()
        opt.clip_grad_norm_(MAX_NORM)
        opt.step()
        sched.step()
        opt.zero_grad()
    return [p.detach().float() for p in model.parameters()]


def run(rank: int, world: int, out_path: str) -> None:
    results = {}
    for case in all_cases():
        ref = _reference(case)
        got = _zeroshard(case, rank, world)
        diff = max((a - b).abs().max().item() for a, b in zip(ref, got))
        # Relative to one bf16 ulp of the reference value (|x| * 2^-7), for the bf16 bound.
        rel = max(((a - b).abs() / (b.abs() * 2.0**-7 + 1e-3)).max().item() for a, b in zip(got, ref))
        results[case.key] = {"max_abs_diff": diff, "ulp_ratio": rel,
                             "finite": all(math.isfinite(t.sum().item()) for t in got)}
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump(results, f)
