"""Single-process round trips: mixed precision (fp32 masters, fp16 loss scale), scheduler and
hyperparameters, rotation; the multi-rank contracts live in test_checkpoint_resume.py."""
from __future__ import annotations

import os

import pytest
import torch

import zeroshard
from tests.support.ckpt_crash_child import params_hex
from tests.support.models import TinyNet, batch, param_groups
from tests.support.asserts import assert_same


def _build(precision, seed=0):
    torch.manual_seed(seed)
    model = TinyNet()
    opt = zeroshard.ZeroOptimizer(param_groups(model, named=True), torch.optim.AdamW, stage=2,
                                  mixed_precision=precision, bucket_size_mb=0.001, lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def _train(model, opt, sched, steps):
    for s in steps:
        opt.backward(model(batch(s, 4)))
        opt.step()
        sched.step()
        opt.zero_grad()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_resume_is_exact(tmp_path, precision):
    ref = _build(precision)
    _train(*ref, range(6))
    run = _build(precision)
    _train(*run, range(3))
    zeroshard.save_checkpoint(str(tmp_path), 3, model=run[0], optimizer=run[1], scheduler=run[2])
    resumed = _build(precision, seed=8)
    zeroshard.load_checkpoint(str(tmp_path), model=resumed[0], optimizer=resumed[1], scheduler=resumed[2])
    assert resumed[1].loss_scale == run[1].loss_scale
    assert [g["lr"] for g in resumed[1].param_groups] == [g["lr"] for g in run[1].param_groups]
    _train(*resumed, range(3, 6))
    assert params_hex(resumed[0]) == params_hex(ref[0])
    masters = [u.master for u in resumed[1].units]
    assert_same([u.master for u in ref[1].units], masters, "fp32 masters")


def test_keep_last_rotation_keeps_the_newest_valid(tmp_path):
    root = str(tmp_path)
    model, opt, _ = _build(None)
    for step in range(1, 5):
        zeroshard.save_checkpoint(root, step, model=model, optimizer=opt, keep_last=2)
    zeroshard.wait_checkpoint()  # rotated-out steps are deleted in the background
    assert sorted(n for n in os.listdir(root) if n.startswith("step-")) == ["step-00000003", "step-00000004"]
    # A damaged newest step does not count as one of the kept: step 4 stays (rotation deletes
    # only valid steps, oldest first) and the newest valid one is never deleted.
    os.truncate(os.path.join(root, "step-00000004", "rank-00000.safetensors"), 10)
    zeroshard.save_checkpoint(root, 5, model=model, optimizer=opt, keep_last=1).wait()
    assert sorted(n for n in os.listdir(root) if n.startswith("step-")) == ["step-00000004", "step-00000005"]
    assert zeroshard.latest_checkpoint(root).endswith("step-00000005")
    with pytest.raises(ValueError, match="keep at least 1"):
        zeroshard.save_checkpoint(root, 6, model=model, optimizer=opt, keep_last=0)
