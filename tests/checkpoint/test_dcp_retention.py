"""``keep_last`` with ``format="dcp"``: the native format's retention, counting native and DCP
steps under one root alike, never counting (nor deleting) a step that is not whole
(Note [retention across formats]). World 1, in this process."""
from __future__ import annotations

import os

import pytest
import torch

import zeroshard
from zeroshard.checkpoint import commit
from zeroshard.checkpoint.checkpoint_errors import CheckpointError


def _trained() -> tuple[torch.nn.Module, zeroshard.ZeroOptimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, stage=1, lr=0.1)
    return model, opt


def _step(model: torch.nn.Module, opt: zeroshard.ZeroOptimizer) -> None:
    model(torch.randn(2, 6)).sum().backward()
    opt.step()
    opt.zero_grad()


def _steps(root: str) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("step-"))


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _loads(root: str, model: torch.nn.Module, opt: zeroshard.ZeroOptimizer, want: dict[str, torch.Tensor]) -> int:
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    got = zeroshard.load_checkpoint(root, model=model, optimizer=opt)
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[k]), k
    return int(got["step"])


def test_dcp_keep_last_keeps_the_newest_steps_of_both_formats(tmp_path):
    root = str(tmp_path)
    model, opt = _trained()
    for step in (1, 2, 3):
        _step(model, opt)
        zeroshard.save_checkpoint(root, step, model=model, optimizer=opt, format="dcp", keep_last=2).wait()
    assert _steps(root) == ["step-00000002", "step-00000003"]
    _step(model, opt)  # a native step in the same root: rotation counts DCP steps too
    zeroshard.save_checkpoint(root, 4, model=model, optimizer=opt, keep_last=2).wait()
    assert _steps(root) == ["step-00000003", "step-00000004"]
    _step(model, opt)  # and a DCP save rotates the native step out
    zeroshard.save_checkpoint(root, 5, model=model, optimizer=opt, format="dcp", keep_last=1, async_save=True).wait()
    assert _steps(root) == ["step-00000005"]
    assert _loads(root, model, opt, _weights(model)) == 5
    with pytest.raises(ValueError, match="keep_last=0: keep at least 1"):
        zeroshard.save_checkpoint(root, 6, model=model, optimizer=opt, format="dcp", keep_last=0)


def test_a_torn_dcp_step_never_pushes_an_older_whole_one_out(tmp_path):
    """Step 3 committed but cut short afterwards, step 4's save killed before its commit: with
    keep_last=2, step 5's save keeps step 2 (the newest whole one before it), not step 3."""
    root = str(tmp_path)
    model, opt = _trained()
    for step in (1, 2, 3):
        _step(model, opt)
        zeroshard.save_checkpoint(root, step, model=model, optimizer=opt, format="dcp").wait()
        if step == 2:
            good = _weights(model)
    data = os.path.join(root, "step-00000003", "__0_0.distcp")
    os.truncate(data, os.path.getsize(data) - 1)

    def die(point: str) -> None:
        if point == "dcp-rename":
            raise OSError("killed before the commit")
    commit.fault_hook = die
    try:
        with pytest.raises(CheckpointError, match="nothing was committed"):
            zeroshard.save_checkpoint(root, 4, model=model, optimizer=opt, format="dcp", keep_last=1).wait()
    finally:
        commit.fault_hook = None
    assert _steps(root) == ["step-00000001", "step-00000002", "step-00000003"]
    with pytest.warns(UserWarning, match="skipping checkpoint .*step-00000003"):
        assert _loads(root, model, opt, good) == 2
    _step(model, opt)
    zeroshard.save_checkpoint(root, 5, model=model, optimizer=opt, format="dcp", keep_last=2).wait()
    assert _steps(root) == ["step-00000002", "step-00000003", "step-00000005"]
    assert _loads(root, model, opt, _weights(model)) == 5
