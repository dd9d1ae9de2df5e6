"""Edges of building a ZeroOptimizer: a refused construction leaves the model as it was, the
stage-3 forward guard keeps the user's exception, sizes and clipping arguments are checked by
name, and the silent multi-process traps (DDP kept around the model, torchrun without a process
group) are refused with the fix."""
from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
from torch import nn

import zeroshard
from zeroshard.testing.launch import spawn
from zeroshard.optim import registry
from zeroshard.planner.auto_placement import MemoryBudget

from tests.support.io_helpers import fill_disk, small_filesystem
from tests.support.models import Block, FrozenBaseNet
from tests.support.asserts import assert_same

A = torch.optim.AdamW


def _record(model: nn.Module) -> dict:
    return {n: (p, p.detach().clone(), p.dtype, p.requires_grad) for n, p in model.named_parameters()}


def _hooks_left(model: nn.Module) -> list[str]:
    left = []
    for name, m in model.named_modules():
        if m._forward_pre_hooks or m._forward_hooks or "forward" in m.__dict__ or "_apply" in m.__dict__:
            left.append(name or "<root>")
        if m._state_dict_hooks or m._load_state_dict_post_hooks:
            left.append(f"{name or '<root>'} state-dict hooks")
    for n, p in model.named_parameters():
        if getattr(p, "_post_accumulate_grad_hooks", None) or p._backward_hooks or hasattr(p, "_zeroshard_owner"):
            left.append(n)
    return left


def _assert_intact(model: nn.Module, before: dict, x: torch.Tensor, out: torch.Tensor) -> None:
    now = dict(model.named_parameters())
    assert list(now) == list(before)
    for n, (p, values, dtype, requires_grad) in before.items():
        assert now[n] is p, f"{n} was replaced"
        assert p.dtype == dtype and p.requires_grad == requires_grad, n
        assert p.untyped_storage().nbytes() >= p.numel() * p.element_size(), f"{n} has no storage"
        assert torch.equal(p.detach(), values), n
    assert _hooks_left(model) == []
    assert torch.equal(model(x), out)
    # and the model can be managed by a new optimizer (nothing claims it)
    opt = zeroshard.ZeroOptimizer(model, A, lr=1e-2, stage=2)
    model(x).sum().backward()
    opt.step()
    opt.close()


def _budget_too_small(**extra) -> dict:
    return dict(offload="auto", memory_budget={"host": 1000, "reserve": 0}, **extra)


REFUSED = [  # (id, kwargs, expected exception, match, needs a full disk)
    ("stage3-nvme-full-disk", dict(stage=3, offload_optimizer="nvme", offload_params="nvme"),
     zeroshard.io.DiskFullError, "No space left", True),
    ("stage2-bf16-nvme-full-disk", dict(stage=2, offload_optimizer="nvme", mixed_precision="bf16"),
     zeroshard.io.DiskFullError, "No space left", True),
    ("stage3-amsgrad-nvme", dict(stage=3, offload_optimizer="nvme", amsgrad=True), ValueError, "amsgrad", False),
    ("stage3-bf16-auto-refused", dict(stage=3, mixed_precision="bf16", **_budget_too_small()),
     ValueError, "memory_budget", False),
    ("stage2-bf16-auto-refused", dict(stage=2, mixed_precision="bf16", **_budget_too_small()),
     ValueError, "memory_budget", False),
    ("stage3-bf16-auto-no-nvme", dict(stage=3, mixed_precision="bf16", offload="auto",
                                      memory_budget={"host": 20_000, "reserve": 0}), ValueError, "without nvme_path",
     False),
]


@pytest.mark.parametrize("case", REFUSED, ids=[c[0] for c in REFUSED])
def test_a_refused_construction_leaves_the_model_intact(case, tmp_path):
    name, kwargs, error, match, full = case
    model = FrozenBaseNet()
    x = torch.randn(3, 8)
    out = model(x)
    before = _record(model)
    cls, opts = A, dict(lr=1e-2)
    if full:
        with small_filesystem(str(tmp_path), size_mb=1) as mnt:
            fill_disk(mnt)
            with pytest.raises(error, match=match):
                zeroshard.ZeroOptimizer(model, cls, nvme_path=mnt, **opts, **kwargs)
            leftover = [f for f in os.listdir(mnt) if f not in ("filler", "lost+found")]
            assert leftover == [], leftover
    else:
        if "offload_optimizer" in kwargs or name.endswith("auto-refused"):
            kwargs = {**kwargs, "nvme_path": str(tmp_path)}
        with pytest.raises(error, match=match):
            zeroshard.ZeroOptimizer(model, cls, **opts, **kwargs)
        assert os.listdir(tmp_path) == []
    _assert_intact(model, before, x, out)


def test_a_refused_meta_model_keeps_its_meta_parameters(tmp_path):
    with torch.device("meta"):
        model = FrozenBaseNet()
    before = {n: p for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="amsgrad"):
        zeroshard.ZeroOptimizer(model, A, lr=1e-2, stage=3, offload_optimizer="nvme", amsgrad=True,
                                nvme_path=str(tmp_path))
    assert all(p is before[n] and p.is_meta for n, p in model.named_parameters())
    assert _hooks_left(model) == []


def test_an_error_after_the_units_are_built_puts_everything_back(tmp_path):
    """Whatever raises once parameters live in flat units (here the inner optimizer's own
    constructor), every parameter gets its own data back and nothing stays hooked."""
    class Picky(torch.optim.SGD):
        def __init__(self, params, lr: float = 0.1) -> None:
            raise RuntimeError("picky optimizer refuses")

    for stage in (1, 3):
        for precision in (None, "bf16"):
            model = FrozenBaseNet()
            x = torch.randn(3, 8)
            out, before = model(x), _record(model)
            with pytest.raises(RuntimeError, match="picky optimizer refuses"):
                zeroshard.ZeroOptimizer(model, Picky, lr=0.1, stage=stage, mixed_precision=precision)
            assert registry.optimizer_for(model) is None
            _assert_intact(model, before, x, out)


def test_a_refusal_after_the_hooks_are_registered_removes_only_its_own():
    """A second optimizer over other parameters of a model the first one manages is refused once
    its gradient hooks exist: its parameters are put back, the first optimizer keeps working."""
    model = FrozenBaseNet()
    first = zeroshard.ZeroOptimizer([{"params": list(model.head.parameters())}], A, lr=1e-2, stage=2, module=model)
    blocks = list(model.blocks.parameters())
    before = [p.detach().clone() for p in blocks]
    with pytest.raises(RuntimeError, match="already managed by a live ZeroOptimizer"):
        zeroshard.ZeroOptimizer([{"params": blocks}], A, lr=1e-2, stage=2, module=model)
    assert registry.optimizer_for(model) is first
    assert_same(before, [p.detach() for p in blocks], "blocks after the refusal")
    assert not any(p._backward_hooks or p._post_accumulate_grad_hooks or hasattr(p, "_zeroshard_owner")
                   for p in blocks)
    head = model.head.weight.detach().clone()
    model(torch.randn(3, 8)).sum().backward()
    first.step()
    assert not torch.equal(model.head.weight.detach(), head)  # the first one still trains
    assert all(p.grad is not None for p in blocks)  # (plain autograd: nothing takes them)


# -- the stage-3 forward guard ----------------------------------------------------------------
class Failing(nn.Module):
    def __init__(self, exc: BaseException) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.exc = exc

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise self.exc


@pytest.mark.parametrize("exc", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                                 RuntimeError("a user's own error"), ValueError("bad input")],
                         ids=["oom", "runtime", "value"])
def test_the_forward_guard_keeps_the_users_exception(exc):
    model = nn.Sequential(Block(), Failing(exc), Block())
    opt = zeroshard.ZeroOptimizer(model, A, lr=1e-2, stage=3, stage3_unit_classes=["Block", "Failing"])
    assert len(opt.units) == 3
    with pytest.raises(type(exc)) as info:
        model(torch.randn(2, 8))
    assert type(info.value) is type(exc) and str(info.value) == str(exc)
    assert "released" not in " ".join(getattr(info.value, "__notes__", []))


class Borrower(nn.Module):
    """Uses the weight of another block, saved while that block was gathered."""

    def __init__(self, lender: Block) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.lender = [lender]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) @ self.lender[0].saved.t()


def test_the_released_diagnosis_is_given_when_a_released_parameter_is_used():
    lender = Block()
    lender.register_forward_hook(lambda mod, args, out: setattr(mod, "saved", mod.lin.weight))
    model = nn.Sequential(lender, Block(), Borrower(lender))
    opt = zeroshard.ZeroOptimizer(model, A, lr=1e-2, stage=3, stage3_unit_classes=["Block", "Borrower"])
    assert len(opt.units) == 3
    with pytest.raises(RuntimeError, match="storage of size 0") as info:
        model(torch.randn(2, 8))
    assert "were released" in " ".join(getattr(info.value, "__notes__", [])), info.value


# -- memory_budget ------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["-1", "abc", "", "inf", "1PB", math.nan, math.inf, -math.inf, "1e400GB", -5,
                                   -2.5e9, "nan", {"host": "-1"}, {"host": math.nan}, {"host": "1e400GB"},
                                   {"device": math.inf, "host": "1GiB"}, {"host": "1GiB", "reserve": -1}])
def test_a_bad_memory_budget_is_refused_by_name(value):
    with pytest.raises(ValueError, match="memory_budget") as info:
        MemoryBudget.parse(value)
    assert type(info.value) is not OverflowError and "\n" not in str(info.value)
    with pytest.raises(ValueError, match="memory_budget"):
        zeroshard.ZeroOptimizer(FrozenBaseNet(), A, lr=1e-2, stage=2, offload="auto", memory_budget=value)


def test_float_and_numpy_budgets_are_bytes_like_an_int():
    assert MemoryBudget.parse(2.5e9) == MemoryBudget.parse(2_500_000_000)
    assert MemoryBudget.parse(np.int64(2**30)) == MemoryBudget.parse(2**30) == MemoryBudget.parse("1GiB")
    assert MemoryBudget.parse(np.float64(1e9)) == MemoryBudget.parse("1GB")
    assert MemoryBudget.parse({"host": np.int32(5000), "reserve": 0.0}) == MemoryBudget(host=5000, reserve=0)
    for value in (2.5e9, np.int64(2**31)):
        opt = zeroshard.ZeroOptimizer(FrozenBaseNet(), A, lr=1e-2, stage=2, offload="auto",
                                      memory_budget={"host": value, "reserve": 0})
        assert opt.engine.placement.plan.budget.host == int(value)


# -- clip_grad_norm_ ------------------------------------------------------------------------------
def _trained(stage: int = 2) -> tuple[nn.Module, zeroshard.ZeroOptimizer]:
    model = FrozenBaseNet()
    opt = zeroshard.ZeroOptimizer(model, A, lr=1e-2, stage=stage)
    model(torch.randn(3, 8)).pow(2).sum().backward()
    return model, opt


@pytest.mark.parametrize("args, named", [((-1.0,), "max_norm=-1.0"), ((math.nan,), "max_norm=nan"),
                                         (("big",), "max_norm='big'"), ((1.0, "two"), "norm_type='two'"),
                                         ((1.0, None), "norm_type=None"), ((1.0, math.nan), "norm_type=nan")])
def test_clip_grad_norm_refuses_bad_arguments_by_name(args, named):
    model, opt = _trained()
    grads = [g.clone() for g in opt.engine.grads.owned_grads()]
    with pytest.raises((ValueError, TypeError), match=named.replace("(", r"\(").replace(".", r"\.")):
        opt.clip_grad_norm_(*args)
    assert_same(opt.engine.grads.owned_grads(), grads, "gradients")  # nothing clipped


def test_clip_grad_norm_takes_what_torch_takes():
    model, opt = _trained()
    two = opt.clip_grad_norm_(1e9)
    assert torch.equal(opt.clip_grad_norm_(1e9, "2"), two)
    assert torch.equal(opt.clip_grad_norm_(torch.tensor(1e9), 2), two)
    assert torch.isfinite(opt.clip_grad_norm_(1e9, "inf"))
    assert torch.equal(opt.clip_grad_norm_(0.0), two)  # (0 is a valid bound: it zeroes the step)
    # torch's own clip_grad_norm_ over the model's parameters (its gradients are the published views)
    for stage in (0, 3):
        model2, opt2 = _trained(stage=stage)
        torch_norm = torch.nn.utils.clip_grad_norm_(model2.parameters(), 1e9)
        assert torch.allclose(torch_norm.double(), opt2.clip_grad_norm_(1e9).double(), rtol=1e-6)


# -- multi-process traps ----------------------------------------------------------------------
def test_world_size_in_the_environment_without_a_process_group_is_refused(monkeypatch):
    assert not torch.distributed.is_initialized()
    for value in ("1", None):
        if value is None:
            monkeypatch.delenv("WORLD_SIZE", raising=False)
        else:
            monkeypatch.setenv("WORLD_SIZE", value)
        zeroshard.ZeroOptimizer(FrozenBaseNet(), A, lr=1e-2, stage=2).close()
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = FrozenBaseNet()
    before = _record(model)
    with pytest.raises(RuntimeError, match=r"WORLD_SIZE=2.*torch\.distributed\.init_process_group"):
        zeroshard.ZeroOptimizer(model, A, lr=1e-2, stage=2)
    assert_same({n: before[n][1] for n, _ in model.named_parameters()},
                {n: p.detach() for n, p in model.named_parameters()}, "parameters after the refusal")
    assert _hooks_left(model) == []


def test_ddp_around_a_managed_model_is_refused_and_the_callback_checks_the_world(tmp_path):
    from tests.support.construction_worker import ddp_and_callback
    spawn(ddp_and_callback, 2, str(tmp_path))
    got = sorted(os.listdir(tmp_path))
    assert {"rank0.ok", "rank1.ok"} <= set(got), got
