"""DeepSpeed's learning-rate schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR) as torch
``LRScheduler`` subclasses, so ``state_dict()`` holds plain numbers and checkpoints resume them.

Step convention (Note [DeepSpeed step offset]): DeepSpeed sets the *initial* learning rate
at construction (its ``last_batch_iteration = -1``) and calls ``step()`` after every optimizer
step, so optimizer step ``k`` (0-based) runs at DeepSpeed iteration ``k - 1``. A torch
scheduler's constructor already takes one step (``last_epoch = 0``) and optimizer step ``k``
runs at ``last_epoch = k``. Hence ``iteration = last_epoch - 1`` below, which reproduces
DeepSpeed's learning rate at every optimizer step with the usual torch loop
``opt.step(); sched.step()``.

State (Note [position-only state]): like DeepSpeed's ``last_batch_iteration``, a checkpoint
keeps only how far the schedule went; its parameters come from the config of the run that
loads it. So resuming the same run reproduces every learning rate exactly, and resuming
with a longer ``total_num_steps`` stretches the rest of the schedule instead of silently
keeping the old end (torch's own schedulers restore every attribute).

Differences from DeepSpeed, on purpose: an unknown ``warmup_type`` raises instead of
falling back to "log" with a warning; ``WarmupCosineLR`` starts every param group at 0
(DeepSpeed zeroes only the first group at iteration -1, an artefact of ``zip`` with a
one-element list).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional, Sequence, Union

import torch
from torch.optim.lr_scheduler import LRScheduler

from zeroshard.config import check_int, check_real

WARMUP_TYPES = ("log", "linear")
Number = Union[float, int]


def _per_group(optimizer: torch.optim.Optimizer, value: Union[Number, Sequence[Number]], name: str) -> list[float]:
    n = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name}={list(value)} has {len(value)} values but the optimizer has {n} param "
                             "groups; give one value or one per group")
        return [float(v) for v in value]
    if isinstance(value, Sequence):  # (a str, a range: neither a number nor a list of them)
        raise TypeError(f"{name}={value!r} must be a number, or a list or tuple of one number per param group")
    return [float(value)] * n


def _check_warmup(warmup_num_steps: int, warmup_type: str) -> None:
    if warmup_type not in WARMUP_TYPES:
        raise ValueError(f"warmup_type={warmup_type!r} is not a DeepSpeed warmup; use one of {WARMUP_TYPES}")
    if not isinstance(warmup_num_steps, int) or warmup_num_steps < 0:
        raise ValueError(f"warmup_num_steps={warmup_num_steps!r} must be a non-negative int")


class _PositionState:
    """Mixin: ``state_dict`` is the position only (Note [position-only state])."""

    last_epoch: int
    optimizer: torch.optim.Optimizer
    if TYPE_CHECKING:  # (LRScheduler's, beside which the mixin is used)
        _step_count: int

        def get_lr(self) -> list[float | torch.Tensor]: ...

    def state_dict(self) -> dict:
        return {"last_epoch": self.last_epoch, "_step_count": self._step_count}

    def load_state_dict(self, state_dict: dict) -> None:
        self.last_epoch = int(state_dict["last_epoch"])
        self._step_count = int(state_dict.get("_step_count", self.last_epoch + 1))
        lrs = self.get_lr()  # the value at this position under *this* run's parameters
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self._last_lr = list(lrs)


def _warmup_fraction(iteration: int, warmup_num_steps: int, warmup_type: str) -> float:
    """DeepSpeed's gamma during warmup: log(i + 1) / log(N) or i / N (N is at least 2)."""
    if warmup_type == "log":
        return math.log(iteration + 1) / math.log(warmup_num_steps)
    return iteration / warmup_num_steps


class WarmupLR(_PositionState, LRScheduler):
    """From ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps`` steps ("log" or
    "linear"), then constant. ``warmup_max_lr=None`` takes the optimizer's (first group) lr."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_min_lr: Union[Number, Sequence[Number]] = 0.0,
                 warmup_max_lr: Union[None, Number, Sequence[Number]] = None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_epoch: int = -1) -> None:
        _check_warmup(warmup_num_steps, warmup_type)
        if warmup_max_lr is None:
            warmup_max_lr = optimizer.param_groups[0]["lr"]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        # DeepSpeed clamps to 2 so that log(N) is never 0.
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        super().__init__(optimizer, last_epoch)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def get_lr(self) -> list[float | torch.Tensor]:
        iteration = self.last_epoch - 1  # Note [DeepSpeed step offset]
        if iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma(iteration)
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay from ``warmup_max_lr`` to ``warmup_min_lr`` at
    ``total_num_steps`` (DeepSpeed's formula: the decay ends at the *minimum* lr, which is 0
    by default)."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int,
                 warmup_min_lr: Union[Number, Sequence[Number]] = 0.0,
                 warmup_max_lr: Union[None, Number, Sequence[Number]] = 0.001, warmup_num_steps: Optional[int] = None,
                 warmup_type: str = "log", last_epoch: int = -1) -> None:
        if not isinstance(total_num_steps, int) or total_num_steps < 1:
            raise ValueError(f"total_num_steps={total_num_steps!r} must be a positive int (the run's "
                             "optimizer steps)")
        check_warmup_within(total_num_steps, warmup_num_steps, "WarmupDecayLR: ")  # (given: DeepSpeed's 1000 is not)
        warmup_num_steps = 1000 if warmup_num_steps is None else warmup_num_steps
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_epoch)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
        return max(0.0, (self.total_num_steps - iteration) / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_PositionState, LRScheduler):
    """A ratio of each group's lr: from ``warmup_min_ratio`` to 1 over ``warmup_num_steps``,
    then a cosine down to ``cos_min_ratio`` at ``total_num_steps``."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = "log",
                 last_epoch: int = -1) -> None:
        _check_warmup(warmup_num_steps, warmup_type)
        if not isinstance(total_num_steps, int) or total_num_steps < 1:
            raise ValueError(f"total_num_steps={total_num_steps!r} must be a positive int")
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.cos_min_ratio = float(cos_min_ratio)
        self.warmup_num_steps = max(2, warmup_num_steps)
        if self.total_num_steps <= self.warmup_num_steps:
            # DeepSpeed divides by (total - warmup) here: refuse instead of a ZeroDivisionError later.
            raise ValueError(f"total_num_steps={total_num_steps} must exceed warmup_num_steps="
                             f"{self.warmup_num_steps} for a cosine decay")
        self.warmup_type = warmup_type
        super().__init__(optimizer, last_epoch)

    def ratio(self, iteration: int) -> float:
        if iteration < 0:
            return 0.0
        if iteration < self.warmup_num_steps:
            r = _warmup_fraction(iteration, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + r * (1.0 - self.warmup_min_ratio)
        done = iteration - self.warmup_num_steps + 1
        span = self.total_num_steps - self.warmup_num_steps
        cosine = (1 + math.cos(math.pi * done / span)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float | torch.Tensor]:
        r = self.ratio(self.last_epoch - 1)  # Note [DeepSpeed step offset]
        return [base * r for base in self.base_lrs]


SCHEDULES: dict[str, type] = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR}


_INT_PARAMS = ("total_num_steps", "warmup_num_steps")
_REAL_PARAMS = ("warmup_min_lr", "warmup_max_lr", "warmup_min_ratio", "cos_min_ratio")


def check_warmup_within(total: object, warmup: object, where: str) -> None:
    """WarmupDecayLR's warmup must end by the run's last step (else the decay would end before
    the warmup does, and the lr would jump from the warmup's value to the minimum)."""
    if isinstance(total, int) and isinstance(warmup, int) and warmup > total:
        raise ValueError(f"{where}warmup_num_steps={warmup} is more than {where}total_num_steps={total}: the decay "
                         "would end before the warmup does. Raise total_num_steps (the run's optimizer steps, warmup "
                         "included) or lower warmup_num_steps")


def check_schedule_params(name: str, params: dict, where: str = "scheduler.params.") -> None:
    """Types and ranges of a schedule's parameters, checked before any state is built; errors
    name the key (``where`` + key) and the fix."""
    if not isinstance(name, str) or name not in SCHEDULES:
        raise ValueError(f"scheduler type {name!r} is not supported; use one of {sorted(SCHEDULES)}")
    for key in _INT_PARAMS:
        if key in params:
            check_int(where + key, params[key], low=0 if key == "warmup_num_steps" else 1)
    for key in _REAL_PARAMS:
        value = params.get(key)
        for v in (value if isinstance(value, (list, tuple)) else [value]):
            if v is not None:
                check_real(where + key, v, low=0.0)
    for key in ("warmup_min_ratio", "cos_min_ratio"):
        if key in params and params[key] > 1:
            raise ValueError(f"{where}{key}={params[key]!r} is a fraction of the lr: use a value in [0, 1]")
    if name == "WarmupCosineLR" and "total_num_steps" in params and \
            params["total_num_steps"] <= max(2, params.get("warmup_num_steps", 1000)):
        raise ValueError(f"{where}total_num_steps={params['total_num_steps']} must exceed warmup_num_steps="
                         f"{max(2, params.get('warmup_num_steps', 1000))} for a cosine decay")
    if name == "WarmupDecayLR":
        check_warmup_within(params.get("total_num_steps"), params.get("warmup_num_steps"), where)
    if name != "WarmupLR" and "total_num_steps" not in params:
        raise ValueError(f"{where}total_num_steps is missing: {name} needs the run's optimizer steps")
    if "warmup_type" in params and params["warmup_type"] not in WARMUP_TYPES:
        raise ValueError(f"{where}warmup_type={params['warmup_type']!r} is not a DeepSpeed warmup; use one of "
                         f"{WARMUP_TYPES}")


def build_schedule(name: str, optimizer: torch.optim.Optimizer, params: Optional[dict] = None) -> LRScheduler:
    """The schedule called ``name`` (a DeepSpeed ``scheduler.type``) over ``optimizer``."""
    params = dict(params or {})
    check_schedule_params(name, {k: v for k, v in params.items() if k != "last_batch_iteration"}, where="")
    last = params.pop("last_batch_iteration", -1)
    if last != -1:
        raise ValueError(f"scheduler.params.last_batch_iteration={last!r}: resume "
                         "schedules from a checkpoint (load_checkpoint(..., scheduler=...)) instead")
    try:
        return SCHEDULES[name](optimizer, **params)
    except TypeError as exc:
        raise TypeError(f"scheduler {name} got parameters {sorted(params)}: {exc}") from exc
