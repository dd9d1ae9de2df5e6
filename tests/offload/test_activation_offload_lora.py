"""offload_activations="cpu" on a LoRA model (peft) whose frozen base and optimizer state stream
from NVMe (stage 3, checkpointed decoder layers): the adapters, the losses and the base are the
same bits as the same run without activation offload, over 8 steps."""
from __future__ import annotations

import os

import pytest
import torch

import zeroshard

pytest.importorskip("peft")

from tests.support import lora_worker as w  # noqa: E402
from tests.support.asserts import assert_same  # noqa: E402


def _run(nvme: str, activations: bool) -> tuple[list[float], dict, dict]:
    model = w._recompute(w.lora_model(torch.float32), True)
    os.makedirs(nvme, exist_ok=True)
    extra = {"offload_activations": zeroshard.ActivationOffload(where="cpu", min_bytes=0)} if activations else {}
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1, stage=3,
                                  offload_params="nvme", offload_optimizer="nvme", nvme_path=nvme, **extra)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    losses = w._steps(model, opt, sched, 0, 8, 0, 1)
    report = opt.placement_report().get("activations", {})
    weights = w.full_weights(model, 3)
    opt.close()
    return losses, weights, report


def test_lora_on_an_offloaded_base_same_bits(tmp_path):
    want_losses, want, _ = _run(str(tmp_path / "a"), False)
    losses, got, report = _run(str(tmp_path / "b"), True)
    assert len(losses) == 8 and losses == want_losses
    assert_same(got, want, "LoRA weights after 8 steps")
    assert report["bytes_moved_last_step"] > 0 and len(report["blocks"]) == 2, report
