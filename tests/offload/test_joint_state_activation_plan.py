"""offload="auto" with a declared micro-batch plans the state and the activations together (Note [joint
state and activation plan]): of the state placements the greedy goes through, the one whose activation
plan gives the least predicted step time (``zeroshard estimate``'s joint choice: test_activation_offload_plan.py's
test_estimate_shows_the_activation_plan). On an accelerator, keeping the state on the device pushes
activations off it where moving the optimizer state to host memory and keeping the activations is faster;
on a CPU, a budget where the state-first plan leaves no room for the activations trains under the joint
plan, with the same bits as without any offload."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest

from zeroshard.offload.activations.planned import least_device, memory_left, shape_of
from zeroshard.offload.activations.workload import PlannedActivations
from zeroshard.planner.activation_plan import Links, best_activations, plan_activations
from zeroshard.planner.auto_placement import Fixed, MemoryBudget, UnitSpec
from zeroshard.planner.joint_plan import plan_joint, state_candidates, state_seconds
from zeroshard.planner.model_shape import ModelShape
from zeroshard.testing.toy import TinyGPT
from zeroshard.units.tier import Tier

from tests.support import act_offload_worker as w
from tests.support.asserts import assert_same

MiB = 2**20


def test_joint_plan_moves_optimizer_state_to_host_rather_than_activations(tmp_path):
    shape = ModelShape(n_params=50_000_000, n_layers=8, d_model=1024, n_heads=8, vocab=1000)
    units = [UnitSpec(i, shard=6 * MiB, master=0, grad=12 * MiB, moments=24 * MiB) for i in range(8)]
    fixed = Fixed(device=64 * MiB)
    state = sum(u.shard + u.grad + u.moments for u in units)
    budget = MemoryBudget(device=fixed.device + state + 800 * MiB, host=4096 * MiB)

    def activations(plan, explain=False):
        plan_in = plan_activations if explain else best_activations
        return plan_in(shape, 4, 4096, 2, **memory_left(plan, budget, True, str(tmp_path)))
    candidates = state_candidates(units, budget, fixed, accelerator=True, nvme=True)
    first = candidates[0]
    assert all(t == Tier.DEVICE for ts in first.tiers for t in ts), "state first: everything on the device"
    sequential = activations(first)
    assert sequential.host_bytes > 0, "state first pushes activations off the device"
    joint = plan_joint(candidates, activations)
    assert joint.chosen > 0 and joint.state.offloads, "the joint plan offloads the optimizer state"
    assert joint.state.bytes_by()["moments"]["host"] > 0 and joint.activations.host_bytes < sequential.host_bytes
    seq_seconds = state_seconds(first, Links()) + sequential.extra_seconds
    assert joint.sequential == pytest.approx((0.0, sequential.extra_seconds))
    assert joint.seconds < seq_seconds, (joint.seconds, seq_seconds)
    assert joint.report()["bytes_moved_per_step"]["activations"] == joint.activations.moved_per_step


@pytest.mark.filterwarnings("ignore:offload='auto'")
def test_joint_plan_trains_where_state_first_refuses_with_the_same_bits(tmp_path):
    d = str(tmp_path)
    over, bucket = {"seq_len": 128}, 0.02  # (long inputs, small units: the state can give up memory finely)
    roomy = w.train_planned(1 << 30, d, True, steps=0, shape_over=over, bucket_size_mb=bucket)  # (planned at build)
    plan = roomy["report"]["plan"]
    assert roomy["joint"]["chosen"] == 0 and roomy["joint"]["sequential"], "a roomy budget: the state-first plan"
    state = (1 << 30) - plan["memory_left"]["device"]
    inp = w.BATCH * 128 * w.CFG.d_model * 4
    cfg = replace(w.CFG, activation_checkpointing=True, **over)
    least = least_device(shape_of(TinyGPT(cfg), cfg.n_layers), PlannedActivations(micro_batch=w.BATCH, seq_len=128),
                         4, {"host": 0})  # (the device bytes of the fully offloaded activation plan)
    budget = None
    for below in range(inp // 2, 2 * inp, inp // 4):  # (under the state plus the least activations: state first refuses)
        try:
            got = w.train_planned(state + least - below, d, True, steps=2, shape_over=over, bucket_size_mb=bucket)
        except ValueError:
            continue
        budget = state + least - below
        break
    assert budget is not None, "no budget under the state-first minimum trains"
    assert got["joint"]["chosen"] > 0 and got["joint"]["sequential_seconds"] is None, got["joint"]
    assert got["joint"]["bytes_moved_per_step"]["state_nvme_written"] > 0, "the joint plan streams state"
    assert math.isfinite(got["joint"]["predicted_seconds"])
    want = w.train_planned(budget, d, False, steps=2, shape_over=over, bucket_size_mb=bucket)
    for step, (g, r) in enumerate(zip(got["grads"], want["grads"])):
        assert_same(g, r, f"gradients of step {step} under the joint plan")
    assert_same(got["weights"], want["weights"], "weights after 2 steps")

