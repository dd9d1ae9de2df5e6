"""Checkpoints written before the drop-in change (zeroshard fb72c90) still load.

``tests/fixtures/ckpt-fb72c90`` was made by that version with TinyNet, AdamW(lr=1e-2,
weight_decay=0.1), batches ``batch(step, 4)`` for steps 0 and 1, ``save_checkpoint(root, 2)``;
``expected/<name>.safetensors`` holds its full weights after one more step (batch 2). The
current code loads each checkpoint into a fresh model and optimizer, takes that step and must
land on the same bits; a checkpoint of one stage also loads into another.
"""
from __future__ import annotations

import os

import pytest
import safetensors.torch as st
import torch

import zeroshard
from tests.models import TinyNet, batch

ROOT = os.path.join(os.path.dirname(__file__), "fixtures", "ckpt-fb72c90")


def _resume(name: str, stage: int, precision):
    torch.manual_seed(1)  # other initial values: everything must come from the checkpoint
    model = TinyNet()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1, stage=stage,
                                  mixed_precision=precision)
    info = zeroshard.load_checkpoint(os.path.join(ROOT, name), model=model, optimizer=opt)
    assert info["step"] == 2
    opt.backward(model(batch(2, 4)))
    opt.step()
    return zeroshard.full_state_dict(model)


@pytest.mark.parametrize("name,stage,precision", [("stage2-fp32", 2, None), ("stage3-fp32", 3, None),
                                                  ("stage2-bf16", 2, "bf16")])
def test_old_checkpoint_resumes_bit_for_bit(name, stage, precision):
    expected = st.load_file(os.path.join(ROOT, "expected", f"{name}.safetensors"))
    got = _resume(name, stage, precision)
    assert sorted(got) == sorted(expected)
    for k, v in expected.items():
        assert torch.equal(got[k], v), k


@pytest.mark.parametrize("name,stage", [("stage2-fp32", 3), ("stage3-fp32", 1)])
def test_old_checkpoint_loads_at_another_stage(name, stage):
    expected = st.load_file(os.path.join(ROOT, "expected", f"{name}.safetensors"))
    got = _resume(name, stage, None)
    for k, v in expected.items():
        assert torch.allclose(got[k], v, rtol=1e-5, atol=1e-6), k
