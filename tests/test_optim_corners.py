"""Issue 39 section 3: the corners of torch.optim a drop-in optimizer must match (single
process; the multi-rank cases run in tests/corners_worker.py). Each failed before its fix."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import zeroshard
from tests.group_state_optim import DistanceAdapted
from tests.models import TinyNet, batch


def _pair(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    model, ref = TinyNet(), TinyNet()
    ref.load_state_dict(model.state_dict())
    return model, ref


def _maxdiff(a: nn.Module, b: nn.Module) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


def _train(pairs, steps: int = 3, first: int = 0) -> None:
    for step in range(first, first + steps):
        for model, opt in pairs:
            opt.zero_grad()
            model(batch(step, 4)).backward()
            opt.step()


# -- 1. values the inner optimizer keeps in its param groups --------------------------------------
@pytest.mark.parametrize("stage", (0, 1, 2, 3))
def test_group_values_written_by_step_persist_and_show(stage, tmp_path):
    model, ref = _pair()
    opt = zeroshard.ZeroOptimizer(model, DistanceAdapted, lr=0.5, stage=stage)
    ropt = DistanceAdapted(ref.parameters(), lr=0.5)
    _train([(model, opt), (ref, ropt)], steps=4)
    assert opt.param_groups[0]["k"] == ropt.param_groups[0]["k"] == 4  # a key the step adds shows
    assert opt.param_groups[0]["d"] == pytest.approx(ropt.param_groups[0]["d"], rel=1e-5)
    assert ropt.param_groups[0]["d"] > 1e-3  # (d grew: the test exercises what it claims)
    assert _maxdiff(model, ref) < 1e-5  # was reset to d0 before every step
    # a checkpoint keeps them: a fresh optimizer resumes with the saved d and k
    zeroshard.save_checkpoint(str(tmp_path), model=model, optimizer=opt, step=4)
    torch.manual_seed(1)
    again = TinyNet()
    opt2 = zeroshard.ZeroOptimizer(again, DistanceAdapted, lr=0.5, stage=stage)
    zeroshard.load_checkpoint(str(tmp_path), model=again, optimizer=opt2)
    assert opt2.param_groups[0]["k"] == 4
    assert opt2.param_groups[0]["d"] == opt.param_groups[0]["d"]
    _train([(again, opt2), (ref, ropt)], steps=2, first=4)
    assert _maxdiff(again, ref) < 1e-5
    assert opt2.param_groups[0]["k"] == 6
