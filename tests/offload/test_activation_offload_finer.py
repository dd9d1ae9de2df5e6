"""Checkpoints finer than a block and the chunked loss under offload="auto" (Note [checkpoints finer
than a block] in zeroshard/testing/toy.py, Note [chunked cross-entropy]): a TinyGPT checkpointed in
halves (attention, MLP) with ``loss_chunk`` set, dropout on, trains with its activations planned
under a budget that moves some blocks: both halves' inputs move in the block's record, the bytes
moved per step are the plan's (which counts two inputs per block), and gradients and weights are the
same bits as the same model without any offload, checkpointed by the model (stages 2 and 3, one
rank) or by the offloader (the mixed plan, stage 2); the planner counts the halves and the chunk."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from zeroshard.cli import main as cli
from zeroshard.offload.activations.planned import least_device, shape_of
from zeroshard.offload.activations.workload import PlannedActivations
from zeroshard.planner.activation_mix import mix_sizes
from zeroshard.planner.activation_plan import _sizes, Links
from zeroshard.planner.model_shape import ModelShape
from zeroshard.testing.toy import TinyGPT

from tests.support import act_offload_worker as w
from tests.support.asserts import assert_same

OVER = {"checkpoint_granularity": "half", "loss_chunk": 24}
BIG = 1 << 30


def test_planner_counts_halves_and_the_chunk(capsys):
    shape = ModelShape(n_params=7_000_000_000, n_layers=32, d_model=4096, n_heads=32, vocab=32000, d_ff=11008)
    tokens, d = 8192, 4096
    whole, finer = _sizes(shape, 1, tokens, 2, Links(), False), _sizes(
        replace(shape, checkpoint_parts=2, loss_chunk=1024), 1, tokens, 2, Links(), False)
    assert whole.block == finer.block == tokens * (9 * d + 2 * 11008) * 2, "a kept block saves the same"
    assert whole.running == whole.block and finer.running == tokens * (2 * d + 2 * 11008 + d) * 2, "MLP half + input"
    assert finer.input == 2 * whole.input == 2 * tokens * d * 2, "two checkpoints' inputs per block"
    assert whole.fixed == 2 * tokens * d * 2 + tokens * 32000 * 10
    assert finer.fixed == 2 * tokens * d * 2 + 1024 * 32000 * 10 + tokens * (2 * d * 2 + 8)
    model = TinyGPT(replace(w.CFG, **OVER))
    assert (shape_of(model, 3).checkpoint_parts, shape_of(model, 3).loss_chunk) == (2, 24)
    assert ModelShape.from_gpt(replace(w.CFG, **OVER), 1).checkpoint_parts == 2
    with pytest.raises(ValueError, match="checkpoint_parts=3"):
        replace(shape, checkpoint_parts=3)
    args = ["estimate", "--params", "7B", "--layers", "32", "--hidden", "4096", "--vocab", "32000", "--gpu-memory",
            "80GB", "--cpu-memory", "512GB", "--nvme", "2TB", "--micro-batch", "1", "--seq-len", "250000", "--json"]
    plans = []
    for extra in ([], ["--loss-chunk", "1024", "--checkpoint-granularity", "half"]):
        assert cli(args + extra) == 0
        plans.append(json.loads(capsys.readouterr().out)["activation_plan"])
    assert "error" in plans[0] and "longest sequence that fits is" in plans[0]["error"], plans[0]
    assert "error" not in plans[1] and sum(plans[1]["blocks"].values()) == 32, plans[1]


@pytest.mark.filterwarnings("ignore:offload='auto'")
@pytest.mark.parametrize("stage", [2, 3])
def test_halves_move_together_same_bits_bytes_as_planned(tmp_path, stage):
    d = str(tmp_path)
    # (4 blocks, prefetch 1: with every input moved two records are back at the peak, so one kept input
    # beside them is a plan that keeps some and moves some)
    kw = dict(shape_over=OVER, stage=stage, n_layers=4, prefetch=1)
    roomy = w.train_planned(BIG, d, True, steps=0, **kw)["report"]["plan"]
    state = BIG - roomy["memory_left"]["device"]
    cfg = replace(w.CFG, activation_checkpointing=True, n_layers=4, **OVER)
    least = least_device(shape_of(TinyGPT(cfg), cfg.n_layers), PlannedActivations(
        micro_batch=w.BATCH, seq_len=cfg.seq_len, prefetch=1), 4, {"host": 0})
    inp = 2 * w.BATCH * cfg.seq_len * cfg.d_model * 4  # (one block's two checkpointed inputs, fp32)
    want = w.train_planned(state + least + inp + inp // 2, d, False, steps=2, **kw)
    got = w.train_planned(state + least + inp + inp // 2, d, True, steps=2, **kw)
    plan = got["report"]["plan"]
    assert plan["blocks"] == {"blocks.0": "checkpoint", "blocks.1": "nvme", "blocks.2": "nvme", "blocks.3": "nvme"}, plan
    assert got["moved"] == [plan["moved_per_step"]] * 2 and plan["moved_per_step"] == 2 * 3 * inp
    for step, (g, r) in enumerate(zip(got["grads"], want["grads"])):
        assert_same(g, r, f"gradients of step {step}, stage {stage}")
    assert_same(got["weights"], want["weights"], "weights after 2 steps")


@pytest.mark.filterwarnings("ignore:offload='auto'")
def test_offloader_checkpoints_in_halves_same_bits(tmp_path):
    d = str(tmp_path)
    kw = dict(declared=False, checkpointed=False, prefetch=1, n_layers=4, shape_over=OVER)
    roomy = w.train_planned(BIG, d, True, steps=1, **kw)
    inp = 2 * w.BATCH * w.CFG.seq_len * w.CFG.d_model * 4
    assert roomy["moved"] == [2 * 3 * inp], "step 1 moves every block's two inputs but the last's (measured)"
    first = roomy["plans"][0]
    state = BIG - first["memory_left"]["device"]
    s = mix_sizes(shape_of(TinyGPT(replace(w.CFG, n_layers=4, **OVER)), 4), w.BATCH, w.CFG.seq_len, 4)
    block = (first["device_bytes"] - s.fixed - s.work) // 4  # (the last block's saved bytes, measured)
    running = -(-block * s.running // s.block)
    assert running < block, "a half recomputed holds less than the block"
    budget = state + s.fixed + s.work + running + 2 * inp + inp // 2  # (one input kept, one brought back)
    want = w.train_planned(budget, d, False, steps=2, peaks=True, **kw)
    got = w.train_planned(budget, d, True, steps=2, peaks=True, **kw)
    plan = got["plans"][-1]
    left = plan["memory_left"]["device"]
    assert max(got["peaks"]) <= left < min(want["peaks"]), (got["peaks"], left, want["peaks"])
    assert plan["blocks"] == {"blocks.0": "nvme", "blocks.1": "nvme", "blocks.2": "nvme", "blocks.3": "checkpoint"}, plan
    assert got["moved"][1] == plan["moved_per_step"] == 2 * 3 * inp
    for step, (g, r) in enumerate(zip(got["grads"], want["grads"])):
        assert_same(g, r, f"gradients of step {step}, halves checkpointed by the offloader")
    assert_same(got["weights"], want["weights"], "weights after 2 steps")
    assert got["forwards_left"] == 0
