"""offload="auto" with ``PlannedActivations(checkpointed=False)``: the model does not checkpoint its
blocks, and the plan picks per block keep / checkpoint / checkpoint + input to NVMe (Note [mixed
activation plans]); the offloader checkpoints the blocks it picks itself (Note [checkpointing chosen
blocks]), dropout on: gradients and weights are the same bits as without any offload, the bytes
moved per step are the plan's, and the step's peak of live tensor bytes (tests/support/live_bytes.py)
is within what the budget leaves after the state, where the run without the plan is over it."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from zeroshard.cli import main as cli
from zeroshard.offload.activations.planned import shape_of
from zeroshard.planner.activation_mix import mix_sizes, plan_mixed
from zeroshard.planner.model_shape import ModelShape
from zeroshard.testing.toy import TinyGPT

from tests.support import act_offload_worker as w
from tests.support.asserts import assert_same

LAYERS = 4  # (prefetch 1: moving inputs frees memory only past the one brought back ahead)


@pytest.mark.filterwarnings("ignore:offload='auto'")
def test_mixed_plan_keeps_checkpoints_and_offloads_with_the_same_bits(tmp_path):
    d = str(tmp_path)
    big = 1 << 30
    kw = dict(declared=False, checkpointed=False, prefetch=1, n_layers=LAYERS)
    roomy = w.train_planned(big, d, True, steps=1, **kw)
    first = roomy["plans"][0]
    tokens = w.BATCH * w.CFG.seq_len
    inp = tokens * w.CFG.d_model * 4
    assert roomy["moved"] == [2 * (LAYERS - 1) * inp], "step 1 checkpoints and moves every block's input but the last"
    assert first["counts"] == {"keep": LAYERS} and first["recompute"] == [], "a roomy budget keeps every block"
    state = big - first["memory_left"]["device"]
    sizes = mix_sizes(shape_of(TinyGPT(replace(w.CFG, n_layers=LAYERS)), LAYERS), w.BATCH, w.CFG.seq_len, 4)
    block = (first["device_bytes"] - sizes.fixed - sizes.work) // LAYERS  # (the last block's saved bytes, measured)
    assert block > 5 * inp, "the measured block's saved tensors, not only its input"
    # (the embeddings' and logits' activations, a block's backward transients, the last block kept, one input
    # kept and one brought back ahead: under one block and three inputs, so two inputs must move)
    budget = state + sizes.fixed + sizes.work + block + 2 * inp + 7 * inp // 8

    want = w.train_planned(budget, d, False, steps=2, peaks=True, **kw)
    got = w.train_planned(budget, d, True, steps=2, peaks=True, **kw)
    plan = got["plans"][-1]
    assert got["plans"] == [plan] * 2, "planned with the measurement after step 1's forward, then kept"
    assert plan["blocks"] == {"blocks.0": "nvme", "blocks.1": "nvme", "blocks.2": "checkpoint",
                              "blocks.3": "keep"}, plan
    assert plan["recompute"] == ["blocks.0", "blocks.1", "blocks.2"] and plan["offloaded"] == ["blocks.0", "blocks.1"]
    assert got["moved"][0] == 2 * 3 * inp, "step 1: every block's input but the last (measured)"
    for moved in got["moved"][1:]:
        assert abs(moved - plan["moved_per_step"]) <= 0.01 * plan["moved_per_step"] and moved == 2 * 2 * inp
    left = plan["memory_left"]["device"]  # (the budget less the state's plan)
    assert plan["device_bytes"] <= left, "the plan's peak within what the budget leaves"
    assert max(got["peaks"]) <= left < min(want["peaks"]), (got["peaks"], left, want["peaks"])
    for step, (g, r) in enumerate(zip(got["grads"], want["grads"])):
        assert_same(g, r, f"gradients of step {step}, blocks checkpointed by the offloader")
    assert_same(got["weights"], want["weights"], "weights after 2 steps")
    assert got["hooks_left"] == 0 and got["forwards_left"] == 0, "close() unwraps the blocks"


def test_mixed_plan_as_memory_shrinks_and_in_estimate(capsys):
    """The pure planner on a 7B-class shape: roomy keeps every block; less memory checkpoints blocks
    (the last kept); less still moves inputs, to host memory first, then NVMe; each plan's peak is
    within the device memory, and moving all of a block's saved tensors is never cheaper than
    recomputing it. ``zeroshard estimate`` shows the per-block choice and the bytes moved per step."""
    shape = ModelShape(n_params=7_000_000_000, n_layers=32, d_model=4096, n_heads=32, vocab=32000)
    s = mix_sizes(shape, 1, 8192, 2)
    seen = []
    for device in (s.fixed + s.work + 32 * s.block, s.fixed + s.work + 4 * s.block,
                   s.fixed + s.work + s.block + 28 * s.input, s.fixed + s.work + s.block + 4 * s.input):
        plan = plan_mixed(shape, 1, 8192, 2, device=device, host=8 * s.input, nvme=1 << 40)
        assert plan.device_bytes <= device and len(plan.blocks) == 32
        assert plan.moved_per_step == 2 * (plan.host_bytes + plan.nvme_bytes)
        seen.append(plan.counts())
    assert seen[0] == {"keep": 32}
    assert seen[1]["keep"] > 1 and seen[1]["checkpoint"] == 32 - seen[1]["keep"]
    assert seen[2].get("host", 0) > 0 and "nvme" not in seen[2] and seen[2]["checkpoint"] > 0, seen[2]
    assert seen[3]["host"] == 8 and seen[3]["nvme"] > 0 and seen[3]["keep"] == 1, seen[3]
    assert not any(k.startswith("saved-") for c in seen for k in c)
    with pytest.raises(ValueError, match=r"longest sequence that fits is \d+ tokens"):
        plan_mixed(shape, 1, 8192, 2, device=s.fixed, host=0, nvme=1 << 40)

    args = ["estimate", "--params", "7B", "--layers", "32", "--hidden", "4096", "--vocab", "32000", "--gpu-memory",
            "80GB", "--cpu-memory", "512GB", "--nvme", "2TB", "--micro-batch", "1", "--seq-len", "90000"]
    assert cli(args + ["--json"]) == 0
    mixed = json.loads(capsys.readouterr().out)["activation_plan"]["not_checkpointed"]
    assert len(mixed["per_block"]) == 32 and len(set(mixed["per_block"])) >= 2, mixed
    moved = sum(1 for p in mixed["per_block"] if p in ("host", "nvme")) * 90000 * 4096 * 2
    assert mixed["moved_per_step"] == 2 * moved > 0
    assert cli(args) == 0
    assert "Blocks not checkpointed by the model (PlannedActivations(checkpointed=False)): blocks 0-" in \
        capsys.readouterr().out
