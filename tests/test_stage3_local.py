"""Stage 3 in one process: meta-device start-up, release after use, full state dicts."""
from __future__ import annotations

import pytest
import torch

import zeroshard
from zeroshard.toy import GPTConfig, TinyGPT, synthetic_batch

CFG = GPTConfig(vocab=32, d_model=16, n_layers=3, n_heads=2, seq_len=8)


def test_meta_model_needs_values_then_trains():
    with torch.device("meta"):
        model = TinyGPT(CFG)
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=3)
    x, y = synthetic_batch(0, 2, CFG)
    with pytest.raises(RuntimeError, match="meta device"):
        model(x, y)
    zeroshard.init_meta_weights(model)
    losses = []
    for step in range(5):
        loss = model(*synthetic_batch(step % 2, 4, CFG))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    sd = zeroshard.full_state_dict(model)
    assert all(torch.isfinite(v).all() for v in sd.values())
    assert sd["blocks.0.fc.weight"].std() > 0  # reset_parameters ran


def test_units_are_released_between_uses_and_memory_is_accounted():
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    plain = TinyGPT(CFG)
    plain.load_state_dict(model.state_dict())
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=3)
    model(*synthetic_batch(0, 2, CFG)).backward()
    opt.step()
    assert all(u.flat.untyped_storage().nbytes() == 0 for u in opt.units)
    assert opt.memory_report().buffers == 0
    assert model.blocks[0].fc.weight.shape == plain.blocks[0].fc.weight.shape  # shapes survive release
    sd = zeroshard.full_state_dict(model)
    assert sorted(sd) == sorted(plain.state_dict())
    assert all(u.flat.untyped_storage().nbytes() == 0 for u in opt.units)  # released again


def test_unit_choice_by_class_and_by_size():
    model = TinyGPT(CFG)
    opt = zeroshard.ZeroOptimizer(model, torch.optim.SGD, lr=0.1, stage=3, stage3_unit_classes=["Block"])
    assert len(opt.units) == CFG.n_layers + 1
    model = TinyGPT(CFG)
    opt = zeroshard.ZeroOptimizer(model, torch.optim.SGD, lr=0.1, stage=3, stage3_unit_numel=1000)
    assert len(opt.units) > CFG.n_layers + 1  # the blocks' linears become units
    with pytest.raises(ValueError, match="matches no module"):
        zeroshard.ZeroOptimizer(TinyGPT(CFG), torch.optim.SGD, lr=0.1, stage=3, stage3_unit_classes=["Nope"])
