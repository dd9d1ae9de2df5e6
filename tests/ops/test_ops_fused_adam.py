"""zeroshard.ops.FusedAdam as a drop-in torch.optim.AdamW / Adam."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from zeroshard.ops import FusedAdam

from tests.support.asserts import assert_same

ATOL, RTOL = 1e-6, 1e-5


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    # Uneven shapes on purpose: 7x15 weights, 1-element bias, sizes off the vector width.
    return nn.Sequential(nn.Linear(15, 7), nn.Tanh(), nn.Linear(7, 33), nn.Tanh(), nn.Linear(33, 1))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int,
           sched: torch.optim.lr_scheduler.LRScheduler | None = None) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 15, generator=gen)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()


def _assert_same_params(a: nn.Module, b: nn.Module) -> None:
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_drop_in_for_torch(adamw_mode: bool) -> None:
    ours, ref = _model(0), _model(0)
    cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    _train(ours, FusedAdam(ours.parameters(), lr=1e-2, weight_decay=0.1, adamw_mode=adamw_mode), 100, seed=1)
    _train(ref, cls(ref.parameters(), lr=1e-2, weight_decay=0.1), 100, seed=1)
    _assert_same_params(ours, ref)


def test_state_and_group_keys_mirror_torch() -> None:
    model = _model(0)
    ours = FusedAdam(model.parameters())
    ref = torch.optim.AdamW(_model(0).parameters())
    assert set(ref.param_groups[0]) <= set(ours.param_groups[0])
    assert ours.param_groups[0]["adamw_mode"] is True
    _train(model, ours, 2, seed=0)
    state = ours.state[next(model.parameters())]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
    assert state["step"].dtype == torch.float32 and state["step"].dim() == 0 and state["step"].item() == 2


def test_state_dict_interchange_both_ways() -> None:
    a, b = _model(0), _model(0)
    opt_a = FusedAdam(a.parameters(), lr=1e-2)
    _train(a, opt_a, 5, seed=1)
    b.load_state_dict(a.state_dict())
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))  # as if saved and loaded
    _train(a, opt_a, 5, seed=2)
    _train(b, opt_b, 5, seed=2)
    _assert_same_params(a, b)
    # And back: torch's state dict (no adamw_mode key) into a fresh FusedAdam.
    c = _model(1)
    c.load_state_dict(b.state_dict())
    opt_c = FusedAdam(c.parameters(), lr=1.0, adamw_mode=True)
    opt_c.load_state_dict(copy.deepcopy(opt_b.state_dict()))
    assert opt_c.param_groups[0]["adamw_mode"] is True and opt_c.param_groups[0]["lr"] == 1e-2
    _train(b, opt_b, 5, seed=3)
    _train(c, opt_c, 5, seed=3)
    _assert_same_params(b, c)


def test_lr_scheduler_and_tensor_lr() -> None:
    ours, ref = _model(0), _model(0)
    opt_o = FusedAdam(ours.parameters(), lr=torch.tensor(1e-2))
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    sched_o = torch.optim.lr_scheduler.StepLR(opt_o, step_size=3, gamma=0.5)
    sched_r = torch.optim.lr_scheduler.StepLR(opt_r, step_size=3, gamma=0.5)
    _train(ours, opt_o, 10, seed=4, sched=sched_o)
    _train(ref, opt_r, 10, seed=4, sched=sched_r)
    _assert_same_params(ours, ref)


def test_maximize_and_param_groups_and_closure() -> None:
    ours, ref = _model(0), _model(0)
    groups_o = [{"params": list(ours[0].parameters()), "weight_decay": 0.0},
                {"params": list(ours[2].parameters()) + list(ours[4].parameters()), "lr": 3e-3}]
    groups_r = [{"params": list(ref[0].parameters()), "weight_decay": 0.0},
                {"params": list(ref[2].parameters()) + list(ref[4].parameters()), "lr": 3e-3}]
    opt_o = FusedAdam(groups_o, lr=1e-2, maximize=True)
    opt_r = torch.optim.AdamW(groups_r, lr=1e-2, maximize=True)
    _train(ours, opt_o, 20, seed=5)
    _train(ref, opt_r, 20, seed=5)
    _assert_same_params(ours, ref)
    x = torch.randn(4, 15)

    def closure() -> torch.Tensor:
        opt_o.zero_grad()
        loss = ours(x).sum()
        loss.backward()
        return loss

    assert torch.is_tensor(opt_o.step(closure))


def test_bf16_params_use_reference_path() -> None:
    p = torch.randn(50, dtype=torch.bfloat16, requires_grad=True)
    q = p.detach().clone().requires_grad_(True)
    opt_o, opt_r = FusedAdam([p], lr=1e-2), torch.optim.AdamW([q], lr=1e-2, foreach=False)
    for _ in range(5):
        g = torch.randn(50, dtype=torch.bfloat16)
        p.grad, q.grad = g.clone(), g.clone()
        opt_o.step()
        opt_r.step()
    assert torch.equal(p, q)


@pytest.mark.parametrize("kwargs, match", [({"lr": -1.0}, "learning rate"), ({"betas": (0.9, 1.0)}, "betas"),
                                           ({"eps": -1.0}, "epsilon"), ({"weight_decay": -0.1}, "weight_decay"),
                                           ({"amsgrad": True}, "amsgrad")])
def test_bad_hyperparameters(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FusedAdam(_model(0).parameters(), **kwargs)


def test_step_grad_scale_equals_prescaled_grads() -> None:
    ours, ref = _model(0), _model(0)
    opt_o = FusedAdam(ours.parameters(), lr=1e-2)
    opt_r = FusedAdam(ref.parameters(), lr=1e-2)
    x = torch.randn(8, 15)
    for _ in range(3):
        for model in (ours, ref):
            model.zero_grad()
            (model(x).pow(2).mean() * 1024).backward()  # a loss-scaled backward
        for p in ref.parameters():
            p.grad.mul_(0.5 / 1024)
        opt_o.step(grad_scale=0.5 / 1024)
        opt_r.step()
    _assert_same_params(ours, ref)


def test_step_in_portions_equals_one_step():
    """``only=`` (the unit-by-unit step of CPU offload) gives the same result as one step."""
    torch.manual_seed(0)
    ps = [torch.randn(1000 + 7 * i, requires_grad=True) for i in range(4)]
    qs = [p.detach().clone().requires_grad_(True) for p in ps]
    for p, q in zip(ps, qs):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    a, b = FusedAdam(ps, lr=1e-2, weight_decay=0.1), FusedAdam(qs, lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        a.step(grad_scale=0.5)
        for part in (qs[:1], qs[1:3], qs[3:]):
            b.step(grad_scale=0.5, only={id(q) for q in part})
    assert_same(qs, ps, "parameters stepped in parts vs all at once")
    untouched = FusedAdam([torch.zeros(3, requires_grad=True)], lr=1.0)
    untouched.param_groups[0]["params"][0].grad = torch.ones(3)
    untouched.step(only=set())
    assert torch.equal(untouched.param_groups[0]["params"][0].detach(), torch.zeros(3))
