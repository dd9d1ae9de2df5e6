"""Stage 3 in one process: meta-device start-up, release after use, full state dicts."""
from __future__ import annotations

import pytest
import torch

import zeroshard
from zeroshard.testing.toy import GPTConfig, TinyGPT, synthetic_batch

from tests.support.asserts import assert_same

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


def test_hugging_face_meta_init_and_base_model_files(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                  bos_token_id=0, eos_token_id=0)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(cfg)
    zeroshard.ZeroOptimizer(model, torch.optim.AdamW, stage=3)
    zeroshard.init_meta_weights(model)  # GPT-2's Conv1D has no reset_parameters: HF's _init_weights
    assert 0.01 < zeroshard.full_state_dict(model)["transformer.h.0.attn.c_attn.weight"].std() < 0.03
    torch.manual_seed(0)
    base = transformers.GPT2Model(cfg).eval()
    base.save_pretrained(tmp_path)  # names without the "transformer." prefix
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(cfg)
    zeroshard.ZeroOptimizer(model, torch.optim.AdamW, stage=3)
    zeroshard.load_safetensors(model, str(tmp_path))
    x = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        got = model.eval()(x, output_hidden_states=True).hidden_states[-1]
        assert torch.equal(got, base(x).last_hidden_state)


def _train_stage3(lend: bool, monkeypatch, offload_params=None, tmp_path=None, steps: int = 3):
    """Losses and final full state of 3 stage-3 steps at world size 1, the gather lending the
    shard's memory (Note [gather by alias]) or copying it as before."""
    from zeroshard.stages.stage3 import gatherer as gatherer_module
    if not lend:
        monkeypatch.setattr(gatherer_module, "can_lend", lambda unit, world_size: False)
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    extra = {} if offload_params is None else dict(offload_params=offload_params, offload_optimizer=offload_params,
                                                   nvme_path=str(tmp_path))
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=3, **extra)
    seen = []  # (unit, flat's data pointer, shard's) while the first block is gathered in forward
    block = model.blocks[0]
    unit = opt.segment_index()[id(block.fc.weight)][0]
    handle = block.register_forward_pre_hook(lambda *a: seen.append(  # (after the gatherer's pre-hook)
        (unit.flat.data_ptr(), unit.shard.data_ptr() if unit.shard.untyped_storage().nbytes() else None)))
    losses = []
    for step in range(steps):
        loss = model(*synthetic_batch(step, 2, CFG))
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    handle.remove()
    released = all(u.flat.untyped_storage().nbytes() == 0 for u in opt.units)
    return losses, zeroshard.full_state_dict(model), seen, released


def test_one_rank_gathers_by_lending_the_shard_bit_for_bit(monkeypatch):
    """Note [gather by alias]: at world size 1 the gathered buffer is the shard's own memory
    while in use (no copy), released after it as before, with the same values bit for bit."""
    lent, lent_sd, seen, released = _train_stage3(True, monkeypatch)
    assert released and all(flat == shard for flat, shard in seen), seen
    monkeypatch.undo()
    copied, copied_sd, seen_copy, released_copy = _train_stage3(False, monkeypatch)
    assert released_copy and all(flat != shard for flat, shard in seen_copy), seen_copy
    assert lent == copied
    assert_same(lent_sd, copied_sd, "state dict, shard lent vs copied")


def test_a_swapped_shard_is_gathered_by_copy_not_lent(monkeypatch, tmp_path):
    """A shard in a swap file is not in memory to lend: the gather reads it as before."""
    losses, _, seen, released = _train_stage3(True, monkeypatch, "nvme", tmp_path, steps=2)
    assert released and seen and all(shard is None or flat != shard for flat, shard in seen), seen


def test_each_unit_steps_through_its_states_and_refuses_an_impossible_move():
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=3)
    gatherer = opt.engine.stage3_gatherer
    from zeroshard.stages.stage3.unit_state import UnitState
    gi = gatherer.group_modules.index(model.blocks[1])
    during: list[list[UnitState]] = []
    hook = model.blocks[1].register_forward_pre_hook(  # (after the gatherer's own pre-hook)
        lambda *_: during.append([gatherer.state[ui] for ui in gatherer.groups[gi]]))
    model(*synthetic_batch(0, 2, CFG)).backward()
    hook.remove()
    assert during == [[UnitState.GATHERED] * len(gatherer.groups[gi])], during
    assert all(s is UnitState.RELEASED for s in gatherer.state), list(gatherer.state)
    ui = gatherer.groups[gi][0]
    with pytest.raises(RuntimeError, match=rf"unit {ui} \(.+\) cannot go from released to gathered \(only from gathering\)"):
        gatherer.state.arrive(ui)
    with pytest.raises(RuntimeError, match=rf"unit {ui} \(.+\) has no collective in flight: it is released"):
        gatherer.state.work(ui)
    opt.step()
