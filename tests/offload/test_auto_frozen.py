"""``offload="auto"`` places stage 3's frozen units (a LoRA base) like any shard: a base that does
not fit the budget streams from NVMe, is read by forward and backward and never written, is
counted by the plan and the report, and trains bit for bit as in memory; what the state leaves
of the budget may take one more prefetched group (Note [prefetch depth])."""
from __future__ import annotations

import pytest
import torch

import zeroshard
from zeroshard.planner.auto_placement import Fixed, MemoryBudget, PlacementError, UnitSpec, plan_auto
from zeroshard.testing.toy import GPTConfig, TinyGPT, synthetic_batch

from tests.support.asserts import assert_same

CFG = GPTConfig(vocab=64, d_model=32, n_layers=6, n_heads=4, seq_len=8)
WIDE = GPTConfig(vocab=8192, d_model=32, n_layers=6, n_heads=4, seq_len=8)
"""CFG with a root unit (embeddings, head) forty times a block."""


def _model(freeze: str) -> TinyGPT:
    torch.manual_seed(0)
    model = TinyGPT(WIDE if freeze == "root" else CFG)
    for name, p in model.named_parameters():
        if (freeze == "base" and name.startswith("blocks.") and name.endswith(".weight") and ".ln" not in name) \
                or (freeze == "root" and not name.startswith("blocks.")):
            p.requires_grad_(False)
    return model


def _auto(tmp_path, budget, freeze: str = "base", **options):
    model = _model(freeze)
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=3, offload="auto",
                                  memory_budget={"host": budget, "reserve": 0}, nvme_path=str(tmp_path), **options)
    return model, opt


def _minimum(tmp_path, freeze: str = "base") -> int:
    with pytest.raises(PlacementError) as info:
        _auto(tmp_path, 0, freeze)
    return info.value.minimum["host"]


def _steps(model, opt, start: int, n: int) -> list[float]:
    losses = []
    for step in range(start, start + n):
        loss = model(*synthetic_batch(step, 2, CFG))
        loss.backward()
        opt.clip_grad_norm_(0.05)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_a_frozen_base_past_the_budget_streams_and_trains_bit_for_bit(tmp_path):
    model, opt = _auto(tmp_path, _minimum(tmp_path))
    rep = opt.placement_report()
    frozen = {u["index"] for u in rep["units"]} - set(range(len(opt.units)))
    assert frozen and len(frozen) == len(opt.engine.frozen_units)
    streamed = [i for i in frozen if rep["units"][i]["shard"] == "nvme"]
    assert streamed, rep["text"]  # (at the minimum every frozen shard it can stream does)
    assert rep["applied"]["shard"] == {"memory": rep["bytes"]["shard"]["host"], "nvme": rep["bytes"]["shard"]["nvme"]}
    losses = _steps(model, opt, 0, 2)
    before = opt.placement_report()["measured_io"]
    losses += _steps(model, opt, 2, 1)
    after = opt.placement_report()
    io = {k: after["measured_io"][k] - before[k] for k in before}
    want = after["predicted_step_io"]
    # The frozen shards are read by forward and backward (less what the cache keeps), never written.
    assert io["frozen_gather_read"] > 0
    assert abs(io["read"] - want["read"]) <= 0.1 * want["read"], (io, want)
    assert io["written"] <= want["written"], (io, want)
    weights = {k: v.clone() for k, v in zeroshard.full_state_dict(model).items()}
    opt.close()

    ref_model = _model("base")
    ref = zeroshard.ZeroOptimizer(ref_model, torch.optim.AdamW, lr=1e-2, stage=3)
    assert _steps(ref_model, ref, 0, 3) == losses  # bit for bit
    assert_same(weights, zeroshard.full_state_dict(ref_model), "weights, auto vs in memory")
    ref.close()


def test_before_a_frozen_base_was_placed_it_sat_outside_the_budget(tmp_path):
    """The budget now covers the base: the plan's memory is within it, and a budget that holds the
    trainable state but not the base streams the base instead of keeping it all in memory."""
    model, opt = _auto(tmp_path, _minimum(tmp_path))
    rep = opt.placement_report()
    assert rep["predicted_memory"]["host"] <= rep["budget"]["host"]
    assert sum(u.shard.numel() * u.shard.element_size() for u in opt.engine.frozen_units if u.swapped("shard")) > 0
    opt.close()


def test_the_memory_the_state_leaves_takes_one_more_prefetched_group(tmp_path):
    # The planner: two 100-byte frozen shards fit beside the fixed costs, the other two stream,
    # and the 50 bytes left hold one more 30-byte group, before the cache gets the rest.
    units = [UnitSpec(i, shard=100, master=0, grad=0, moments=0, frozen=True) for i in range(4)]
    fixed = Fixed(device=40, group=30)
    plan = plan_auto(units, MemoryBudget(host=290), fixed, accelerator=False, nvme=True, deeper=30)
    assert plan.deeper == 30 and sum(plan.tier(i, "shard") == "nvme" for i in range(4)) == 2
    assert plan.memory()["host"] <= 290 and not plan.cached  # (20 bytes left: no shard fits)
    assert plan.step_io() == {"read": 2 * 2 * 100, "written": 0}  # frozen: read twice, never written
    assert plan_auto(units, MemoryBudget(host=260), fixed, accelerator=False, nvme=True, deeper=30).deeper == 0

    # The optimizer: a frozen root unit (embeddings, head) too big for the budget streams, and
    # the memory it leaves holds a block group: stage 3 keeps three groups live, unless told.
    state = _auto(tmp_path, 2**40, freeze="root")[1]
    total = sum(b for kind in state.placement_report()["bytes"].values() for b in kind.values())
    root = max(u.shard.numel() * u.shard.element_size() for u in state.engine.frozen_units)
    state.close()
    budget = _minimum(tmp_path, "root") + total - root + root // 4  # (all but the root, and a quarter of it)
    model, opt = _auto(tmp_path, budget, freeze="root")
    rep = opt.placement_report()
    assert any("prefetch" in r for r in rep["reasons"]), rep["text"]
    assert opt.engine.gatherer.max_live == 3
    losses = _steps(model, opt, 0, 2)
    opt.close()
    model, opt = _auto(tmp_path, budget, freeze="root", max_live_units=2)
    assert opt.engine.gatherer.max_live == 2 and not any("prefetch" in r for r in opt.placement_report()["reasons"])
    assert _steps(model, opt, 0, 2) == losses  # (the depth changes when reads start, not values)
    opt.close()
