"""Checkpoints written before the drop-in change (zeroshard fb72c90) still load.

``tests/support/fixtures/ckpt-fb72c90`` was made by that version with TinyNet, AdamW(lr=1e-2,
weight_decay=0.1), batches ``batch(step, 4)`` for steps 0 and 1, ``save_checkpoint(root, 2)``;
``expected/<name>.safetensors`` holds its full weights after one more step (batch 2). The
current code loads each checkpoint into a fresh model and optimizer and takes that step. It
must land on the bits of the same step taken from that state saved again by the current code
and loaded back (the old files load exactly what the new ones hold), and within float
rounding of the fixture: the step's own bits depend on the CPU's kernels (on a Sapphire Rapids
machine 12 of emb.weight's 480 values differ from the fixture's by one ulp, the gradients being
equal to plain torch's there). A checkpoint of one stage also loads into another.
"""
from __future__ import annotations

import os

import pytest
import safetensors.torch as st
import torch

import zeroshard
from tests.support.models import TinyNet, batch

ROOT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "support", "fixtures", "ckpt-fb72c90")


def _resume(path: str, stage: int, precision, save_to: str = ""):
    torch.manual_seed(1)  # other initial values: everything must come from the checkpoint
    model = TinyNet()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1, stage=stage,
                                  mixed_precision=precision)
    info = zeroshard.load_checkpoint(path, model=model, optimizer=opt)
    assert info["step"] == 2
    if save_to:
        zeroshard.save_checkpoint(save_to, 2, model=model, optimizer=opt)
    opt.backward(model(batch(2, 4)))
    opt.step()
    return zeroshard.full_state_dict(model)


@pytest.mark.parametrize("name,stage,precision", [("stage2-fp32", 2, None), ("stage3-fp32", 3, None),
                                                  ("stage2-bf16", 2, "bf16")])
def test_old_checkpoint_resumes_bit_for_bit(name, stage, precision, tmp_path):
    expected = st.load_file(os.path.join(ROOT, "expected", f"{name}.safetensors"))
    got = _resume(os.path.join(ROOT, name), stage, precision, save_to=str(tmp_path))
    again = _resume(str(tmp_path), stage, precision)
    assert sorted(got) == sorted(expected) == sorted(again)
    for k, v in expected.items():
        assert torch.equal(got[k], again[k]), k
        assert torch.allclose(got[k].float(), v.float(), rtol=1e-6, atol=2e-7), k


@pytest.mark.parametrize("name,stage", [("stage2-fp32", 3), ("stage3-fp32", 1)])
def test_old_checkpoint_loads_at_another_stage(name, stage):
    expected = st.load_file(os.path.join(ROOT, "expected", f"{name}.safetensors"))
    got = _resume(os.path.join(ROOT, name), stage, None)
    for k, v in expected.items():
        assert torch.allclose(got[k], v, rtol=1e-5, atol=1e-6), k
