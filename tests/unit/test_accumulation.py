"""Gradient accumulation when a reduction is still in flight as the next micro-batch starts.

A model small enough to be one bucket leaves its reduction in flight at the end of backward
(up to ``max_inflight_buckets`` stay pending). At stages 0-1 the first backward reduces in
place in the gradient store; the next micro-batch must not take that store as its bucket
again (it once did, and silently dropped the first micro-batch's gradient)."""
from __future__ import annotations

import copy

import pytest
import torch

import zeroshard
from zeroshard.testing.toy import TinyGPT, synthetic_batch

from tests.support.models import TINY_GPT

CFG = TINY_GPT


@pytest.mark.parametrize("stage", (0, 1, 2, 3))
@pytest.mark.parametrize("inflight", (1, 2))
def test_every_micro_batch_counts(stage, inflight):
    torch.manual_seed(0)
    ref = TinyGPT(CFG)
    model = copy.deepcopy(ref)
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=stage, max_inflight_buckets=inflight)
    assert len(opt.units) == 1 or stage == 3
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(2):
        for k in range(3):
            (model(*synthetic_batch(3 * step + k, 4, CFG)) / 3).backward()
            (ref(*synthetic_batch(3 * step + k, 4, CFG)) / 3).backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    got = zeroshard.full_state_dict(model)
    for name, p in ref.named_parameters():
        assert (got[name] - p.detach()).abs().max() < 1e-6, name
