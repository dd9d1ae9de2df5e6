"""offload="auto" with a declared micro-batch plans the state and the activations together (Note [joint
state and activation plan]): of the state placements the greedy goes through, the one whose activation
plan gives the least predicted step time (``zeroshard estimate``'s joint choice: test_activation_offload_plan.py's
test_estimate_shows_the_activation_plan). On an accelerator, keeping the state on the device pushes
activations off it where moving the optimizer state to host memory and keeping the activations is faster;
on a CPU, a budget where the state-first plan leaves no room for the activations trains under the joint
plan, with the same bits as without any offload, and so does the shape measured at the first forward
(``PlannedActivations()``): planned there with the state as a declared shape is at construction, the state
moved to that placement before the first block runs (Note [state re-placed at the first forward] in
zeroshard/offload/placement_replan.py). Before that, state first: the measured sequence was refused. A
budget no candidate meets is refused at the first forward with the declared run's message (the longest
sequence and the smallest budget that fit). Moments loaded from a checkpoint before the first forward
move with their values (a resumed run: the same bits as resumed with the shape declared). Stage 3, whose
shape is read from the model's input: test_joint_plan_stage3.py."""
from __future__ import annotations

import math
import re
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


def _free_disk(exc: BaseException) -> str:
    """The refusal's text with the NVMe directory's free space left out: other processes write to
    the same disk between the two runs (seen: 70.93 vs 70.94 GiB)."""
    return re.sub(r"NVMe \d+(\.\d+)? GiB", "NVMe _ GiB", str(exc))


def test_joint_plan_moves_optimizer_state_to_host_rather_than_activations(tmp_path):
    shape = ModelShape(n_params=50_000_000, n_layers=8, d_model=1024, n_heads=8, vocab=1000)
    units = [UnitSpec(i, shard=6 * MiB, master=0, grad=12 * MiB, moments=24 * MiB) for i in range(8)]
    fixed = Fixed(device=64 * MiB)
    state = sum(u.shard + u.grad + u.moments for u in units)
    budget = MemoryBudget(device=fixed.device + state + 1300 * MiB, host=4096 * MiB)

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


OVER, BUCKET, SEQ = {"seq_len": 128}, 0.02, 128  # (long inputs, small units: the state can give up memory finely)


def _train(budget: int, directory: str, declared: bool, steps: int = 2, planned: bool = True, **kw) -> dict:
    return w.train_planned(budget, directory, planned, steps=steps, declared=declared, shape_over=OVER,
                           bucket_size_mb=BUCKET, **kw)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("nvme"))
    roomy = _train(1 << 30, d, True, steps=0)  # (planned at construction: the state's memory, no step)
    state = (1 << 30) - roomy["report"]["plan"]["memory_left"]["device"]
    cfg = replace(w.CFG, activation_checkpointing=True, **OVER)
    least = least_device(shape_of(TinyGPT(cfg), cfg.n_layers), PlannedActivations(micro_batch=w.BATCH, seq_len=SEQ),
                         4, {"host": 0})  # (the device bytes of the fully offloaded activation plan)
    budget = state + least - w.BATCH * SEQ * w.CFG.d_model * 2  # (half an input under it: state first refuses)
    return {"budget": budget, "state": state, "dir": d, "declared": _train(budget, d, True, state_dicts=True),
            "state_first": _train(budget, d, True, planned=False)}


@pytest.fixture(scope="module")
def measured(runs):
    return _train(runs["budget"], runs["dir"], False)  # (the shape measured at the first forward)


@pytest.mark.filterwarnings("ignore:offload='auto'")
def test_joint_plan_trains_where_state_first_refuses_with_the_same_bits(runs):
    got, want = runs["declared"], runs["state_first"]  # (want: no activation plan, the state placed first)
    assert got["joint"]["chosen"] > 0 and got["joint"]["sequential_seconds"] is None, got["joint"]
    assert got["joint"]["bytes_moved_per_step"]["state_nvme_written"] > 0, "the joint plan streams state"
    assert math.isfinite(got["joint"]["predicted_seconds"])
    for step, (g, r) in enumerate(zip(got["grads"], want["grads"])):
        assert_same(g, r, f"gradients of step {step} under the joint plan")
    assert_same(got["weights"], want["weights"], "weights after 2 steps")


@pytest.mark.filterwarnings("ignore:offload='auto'")
def test_measured_shape_trains_under_the_declared_joint_plan_with_its_bits(runs, measured):
    declared = runs["declared"]
    assert measured["joint"]["chosen"] == declared["joint"]["chosen"], (measured["joint"], declared["joint"])
    assert measured["report"]["plan"]["blocks"] == declared["report"]["plan"]["blocks"]
    assert measured["state"] == declared["state"], "the state lives where the declared run keeps it"
    assert measured["state"]["applied"]["moments"]["nvme"] > 0, "the joint plan streams moments"
    for step, (g, r) in enumerate(zip(measured["grads"], declared["grads"])):
        assert_same(g, r, f"gradients of step {step}, shape measured vs declared")
    assert_same(measured["weights"], declared["weights"], "weights after 2 steps, shape measured vs declared")


@pytest.mark.filterwarnings("ignore:offload='auto'")
def test_report_says_planned_at_the_first_forward_what_moved_and_refuses_as_declared(runs, measured):
    joint, first = measured["joint"], runs["state_first"]["state"]["units"]
    assert joint["planned"] == "first forward" and joint["re_placed"], joint
    assert runs["declared"]["joint"]["planned"] == "construction"
    want = [{"unit": a["index"], "kind": k, "from": a[k], "to": b[k]}
            for a, b in zip(first, runs["declared"]["state"]["units"]) for k in a if k not in ("index", "cached")
            and a[k] != b[k]]  # (the state-first placement against the joint one, as the declared run holds it)
    assert want and [{k: m[k] for k in ("unit", "kind", "from", "to")} for m in joint["moved"]] == want
    assert joint["moved_bytes"] == sum(m["bytes"] for m in joint["moved"]) > 0
    # a budget no candidate meets: the joint search's refusal, at the first forward, as at construction
    budget = runs["state"]
    with pytest.raises(ValueError) as at_build:
        _train(budget, runs["dir"], True, steps=1)
    with pytest.raises(ValueError) as at_forward:
        _train(budget, runs["dir"], False, steps=1)
    assert "the longest sequence that fits is" in str(at_forward.value)
    assert _free_disk(at_forward.value) == _free_disk(at_build.value)


def _resumed(budget: int, directory: str, declared: bool, saved: tuple[dict, dict]) -> dict:
    return w.resumed_planned(budget, directory, declared, saved, OVER, BUCKET)


@pytest.mark.filterwarnings("ignore:offload='auto'")
def test_moments_loaded_before_the_first_forward_move_with_their_values(runs):
    saved = runs["declared"]["saved"]  # (after 2 steps under the joint plan: moments with values)
    declared, measured = (_resumed(runs["budget"], runs["dir"], d, saved) for d in (True, False))
    assert measured["joint"]["re_placed"] and measured["joint"]["moved"], measured["joint"]
    assert measured["units"] == declared["units"]
    assert_same(measured["grads"], declared["grads"], "gradients of the resumed step, shape measured vs declared")
    assert_same(measured["weights"], declared["weights"], "weights after the resumed step (moments moved with values)")
