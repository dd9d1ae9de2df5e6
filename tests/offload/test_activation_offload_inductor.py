"""Activation offload under torch.compile with inductor (Note [activation offload under inductor]):
a model compiled whole is refused at its first forward (its compiled forward, split at the
offloader's hooks, gives other bits: other dropout masks, other fusion), explicit and planned
forms alike, unless inductor_split=True (then it trains, the blocks moving); each block's forward compiled instead gives the same
bits as without offload, dropout on, with the blocks moving."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import zeroshard
from zeroshard.offload.activations.workload import PlannedActivations
from zeroshard.testing.toy import TinyGPT, synthetic_batch

from tests.support import act_offload_worker as w
from tests.support.asserts import assert_same

pytestmark = pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace",
                                        "ignore:offload='auto'")


def _run(stage: int, checkpointing: bool, offload: dict, whole: bool, steps: int = 2) -> tuple[list, list]:
    """Gradients of each step and the bytes moved, TinyGPT (dropout 0.1) compiled with inductor: the
    whole model, or each block's forward."""
    cfg = replace(w.CFG, activation_checkpointing=checkpointing)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    opt = zeroshard.ZeroOptimizer(model, torch.optim.SGD, lr=0.1, stage=stage, **offload)
    if whole:
        call = torch.compile(model)
    else:
        for block in model.blocks:
            block.forward = torch.compile(block.forward)
        call = model
    torch.manual_seed(1)
    grads, moved = [], []
    try:
        for step in range(steps):
            call(*synthetic_batch(step, w.BATCH, cfg)).backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
            opt.step()
            opt.zero_grad()
            if offload:
                moved.append(opt.placement_report()["activations"]["bytes_moved_last_step"])
    finally:
        opt.close()
        torch._dynamo.reset()
    return grads, moved


def test_whole_model_under_inductor_refused_per_block_compile_same_bits():
    cpu = {"offload_activations": zeroshard.ActivationOffload(where="cpu", min_bytes=0)}
    planned = {"offload": "auto", "memory_budget": 1 << 30, "offload_activations": PlannedActivations(checkpointed=False)}
    for stage, ckpt, kw in ((1, True, cpu), (3, False, planned)):
        with pytest.raises(RuntimeError, match=r"compiled whole.*b\.forward = torch\.compile.*inductor_split=True"):
            _run(stage, ckpt, kw, whole=True, steps=1)
    want, _ = _run(1, True, {}, whole=False)
    got, moved = _run(1, True, cpu, whole=False)
    assert all(m > 0 for m in moved), moved
    for step, (g, r) in enumerate(zip(got, want)):
        assert_same(g, r, f"step {step}: each block compiled with inductor, offload against none")
    split = {"offload_activations": zeroshard.ActivationOffload(where="cpu", min_bytes=0, inductor_split=True)}
    _, moved = _run(1, True, split, whole=True)  # (accepted: runs, the blocks move)
    assert all(m > 0 for m in moved), moved
