"""torch code on gradients that live in a swap file (``offload_optimizer="nvme"``): what it
does is exact, and costs a read of each unit per pass over the parameters, not one per parameter (Note
[parts held for torch code] in zeroshard/offload/unit_swap.py).

The oracle is the same model with everything in memory, running the same torch code: losses
and weights bit for bit, while the swap file's counters bound the I/O."""
from __future__ import annotations

import pytest
import torch

from tests.support.nvme_params_worker import make
from tests.support.asserts import assert_same
from zeroshard.testing.toy import GPTConfig, synthetic_batch

CFG = GPTConfig(vocab=64, d_model=32, n_layers=4, n_heads=4, seq_len=8)


def _grad_bytes(opt) -> int:
    return sum(u.grad_store.numel() * u.grad_store.element_size() for u in opt.units)


def _train(opt, model, steps: int, between) -> list[float]:
    losses = []
    for step in range(steps):
        loss = model(*synthetic_batch(step, 2, CFG))
        loss.backward()
        between(model, opt, step)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _torch_clip(model, opt, step) -> None:
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # (bites: the norm is ~1)


def _scale_then_clip(model, opt, step) -> None:
    for p in model.parameters():  # a user's own per-parameter edit, then torch's clip
        if p.grad is not None:
            p.grad.mul_(0.5)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("between", [_torch_clip, _scale_then_clip], ids=["torch-clip", "edit-then-clip"])
def test_torch_code_on_swapped_gradients_is_exact_and_reads_each_unit_once(stage, between, tmp_path):
    runs = {}
    for where in ("memory", "nvme"):
        model, opt = make(str(tmp_path) if where == "nvme" else None, stage=stage, cfg=CFG,
                          params="nvme" if stage == 3 else None)
        if where == "nvme":
            grads = _grad_bytes(opt)
            seen = []

            def counted(model, opt, step, seen=seen):
                before = opt.placement_report()["measured_io"]
                between(model, opt, step)
                after = opt.placement_report()["measured_io"]
                seen.append((after["read"] - before["read"], after["written"] - before["written"]))
            losses = _train(opt, model, 4, counted)
            # Each unit's gradient is read once per pass over the parameters (norms, then the
            # multiplication: the held units cannot all stay here) and an edited one written
            # once as it leaves memory; per parameter it would be ~10x the gradients' bytes.
            for read, written in seen:
                assert read <= 2 * grads, (read, grads, seen)
                assert written <= grads, (written, grads, seen)
        else:
            losses = _train(opt, model, 4, between)
        runs[where] = (losses, [p.detach().clone() for p in _full_params(model, opt)])
        opt.close()
    assert runs["nvme"][0] == runs["memory"][0]  # bit for bit
    assert_same(runs["memory"][1], runs["nvme"][1], "parameters, NVMe vs memory")


def _full_params(model, opt) -> list[torch.Tensor]:
    import zeroshard
    return list(zeroshard.full_state_dict(model).values()) if opt.stage == 3 else \
        [p.detach() for p in model.parameters()]


def test_an_edited_gradient_kept_past_the_step_is_written_before_it_leaves(tmp_path):
    """Gradients edited by torch code and not cleared accumulate into the next backward: the
    edit must have reached the file (or stayed in memory), never be dropped."""
    runs = {}
    for where in ("memory", "nvme"):
        model, opt = make(str(tmp_path) if where == "nvme" else None, stage=3, cfg=CFG)
        losses = []
        for step in range(3):
            for k in range(2):  # two backwards per step, edited in between (no zero_grad)
                loss = model(*synthetic_batch(2 * step + k, 2, CFG))
                loss.backward()
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(0.75)
                losses.append(loss.item())
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
            opt.zero_grad(set_to_none=(step % 2 == 0))
        runs[where] = (losses, [t.clone() for t in _full_params(model, opt)])
        opt.close()
    assert runs["nvme"][0] == runs["memory"][0]
    assert_same(runs["memory"][1], runs["nvme"][1], "parameters, NVMe vs memory")
