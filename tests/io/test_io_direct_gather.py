"""Stage-3 gathers of a frozen base kept in the swap file (the LoRA-past-memory path): the
shard is read straight into the gathered buffer with O_DIRECT, exactly twice a step (forward
and backward), counted by ``placement_report()["measured_io"]``; where the file system refuses
O_DIRECT the same reads go through the page cache with the same values bit for bit."""
from __future__ import annotations


import pytest
import torch

import zeroshard
from zeroshard.testing.toy import GPTConfig, TinyGPT, synthetic_batch

from tests.support.io_helpers import refuse_o_direct

CFG = GPTConfig(vocab=64, d_model=64, n_layers=3, n_heads=2, seq_len=8)
STEPS = 3


def _run(tmp_path, refuse_direct: bool, monkeypatch) -> tuple[list[float], list[dict], int]:
    """Trains a model whose blocks' linear weights are frozen (a base) with the rest trainable
    (the adapters' stand-in), every shard in the swap file; (losses, per-step measured_io
    deltas, the frozen units' shard bytes)."""
    if refuse_direct:  # as tmpfs before Linux 6.6: every O_DIRECT open() fails with EINVAL
        refuse_o_direct(monkeypatch)
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    for block in model.blocks:
        for lin in (block.qkv, block.fc, block.out):
            lin.weight.requires_grad_(False)
    swap = tmp_path / ("buffered" if refuse_direct else "direct")
    swap.mkdir()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=3, offload_optimizer="nvme",
                                  offload_params="nvme", nvme_path=str(swap))
    frozen = sum(u.shard.numel() * u.shard.element_size() for u in opt.engine.frozen_units)
    losses, io = [], []
    for step in range(STEPS):
        before = opt.placement_report()["measured_io"]
        loss = model(*synthetic_batch(step, 2, CFG))
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        after = opt.placement_report()["measured_io"]
        io.append({k: after[k] - before[k] for k in before})
    opt.close()
    return losses, io, frozen


def test_a_swapped_frozen_base_is_read_twice_a_step_straight_into_the_gather(tmp_path, monkeypatch):
    losses, io, frozen = _run(tmp_path, False, monkeypatch)
    assert frozen > 0
    for step in io:  # forward and backward each read every frozen unit's shard once, no more
        assert step["frozen_gather_read"] == 2 * frozen, (step, frozen)
        assert step["gather_read"] >= step["frozen_gather_read"] and step["gather_wait_s"] >= 0
        # (the base's reads go through O_DIRECT into the aligned gathered buffers; a few small
        # tails of the trainable parts may not)
        assert step["direct"] >= step["frozen_gather_read"], step
    monkeypatch.undo()
    buffered, io_buffered, _ = _run(tmp_path, True, monkeypatch)
    assert buffered == losses  # bit for bit through the page cache
    assert all(s["direct"] == 0 and s["frozen_gather_read"] == 2 * frozen for s in io_buffered), io_buffered


def test_measured_io_names_the_gather_reads(tmp_path):
    model = TinyGPT(CFG)
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=3)
    io = opt.placement_report()["measured_io"]
    assert {"gather_read", "frozen_gather_read", "gather_wait_s"} <= set(io)
    assert io["gather_read"] == 0 and io["gather_wait_s"] == 0


if __name__ == "__main__":
    pytest.main([__file__, "-q"])


def _prefetched(max_live: int, tmp_path) -> tuple[list[float], list[int]]:
    """Losses of 3 steps and, at each block's forward in steps 2-3, how many later blocks were
    already gathered or being read (Note [prefetch depth])."""
    from zeroshard.stages.stage3.gatherer import UnitState
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=64, d_model=64, n_layers=5, n_heads=2, seq_len=8)
    model = TinyGPT(cfg)
    tmp_path.mkdir()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=3, offload_optimizer="nvme",
                                  offload_params="nvme", nvme_path=str(tmp_path), max_live_units=max_live)
    index = opt.segment_index()
    block_units = [index[id(b.fc.weight)][0] for b in model.blocks]
    ahead: list[int] = []
    step = [0]

    def count(i: int):
        def hook(*_):
            if step[0] > 0:
                ahead.append(sum(opt.engine.gatherer.state[opt.units.index(u)] is not UnitState.RELEASED
                                 for u in block_units[i + 1:]))
        return hook
    for i, b in enumerate(model.blocks):
        b.register_forward_pre_hook(count(i))
    losses = []
    for step[0] in range(3):
        loss = model(*synthetic_batch(step[0], 2, cfg))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    opt.close()
    return losses, ahead


def test_prefetch_reads_max_live_minus_one_units_ahead_with_the_same_values(tmp_path):
    one, ahead_one = _prefetched(2, tmp_path / "a")
    three, ahead_three = _prefetched(4, tmp_path / "b")
    assert one == three
    assert max(ahead_one) == 1 and max(ahead_three) == 3, (ahead_one, ahead_three)
