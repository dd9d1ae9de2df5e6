"""offload="auto" with the micro-batch measured at the first forward (``PlannedActivations()``) plans the
state with the activations there, as a declared shape does at construction, and moves the state to
that placement before the first block runs (Note [state re-placed at the first forward] in
zeroshard/offload/placement_replan.py): under a budget where the state placed first leaves the
activations too little (the old behaviour: refused at the first forward), the measured run picks the
declared run's joint plan, holds its state where the declared run holds it, trains with its bits, and
its ``placement_report()["joint"]`` says it was planned at the first forward and which parts moved.
A budget no candidate meets is refused there with the declared run's message (the longest sequence
and the smallest budget that fit)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from zeroshard.offload.activations.planned import least_device, shape_of
from zeroshard.offload.activations.workload import PlannedActivations
from zeroshard.testing.toy import TinyGPT

from tests.support import act_offload_worker as w
from tests.support.asserts import assert_same

OVER, BUCKET, SEQ = {"seq_len": 128}, 0.02, 128  # (long inputs, small units: the state can give up memory finely)


def _train(budget: int, directory: str, declared: bool, steps: int = 2, planned: bool = True) -> dict:
    return w.train_planned(budget, directory, planned, steps=steps, declared=declared, shape_over=OVER,
                           bucket_size_mb=BUCKET)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("nvme"))
    roomy = _train(1 << 30, d, True, steps=0)  # (planned at construction: the state's memory, no step)
    state = (1 << 30) - roomy["report"]["plan"]["memory_left"]["device"]
    cfg = replace(w.CFG, activation_checkpointing=True, **OVER)
    least = least_device(shape_of(TinyGPT(cfg), cfg.n_layers), PlannedActivations(micro_batch=w.BATCH, seq_len=SEQ),
                         4, {"host": 0})  # (the device bytes of the fully offloaded activation plan)
    budget = state + least - w.BATCH * SEQ * w.CFG.d_model * 2  # (half an input under it: state first refuses)
    return {"budget": budget, "state": state, "dir": d, "declared": _train(budget, d, True),
            "measured": _train(budget, d, False), "state_first": _train(budget, d, True, steps=0, planned=False)}


@pytest.mark.filterwarnings("ignore:offload='auto'")
def test_measured_shape_trains_under_the_declared_joint_plan_with_its_bits(runs):
    declared, measured = runs["declared"], runs["measured"]
    assert declared["joint"]["chosen"] > 0 and declared["joint"]["sequential_seconds"] is None, declared["joint"]
    assert measured["joint"]["chosen"] == declared["joint"]["chosen"], (measured["joint"], declared["joint"])
    assert measured["report"]["plan"]["blocks"] == declared["report"]["plan"]["blocks"]
    assert measured["state"] == declared["state"], "the state lives where the declared run keeps it"
    assert measured["state"]["applied"]["moments"]["nvme"] > 0, "the joint plan streams moments"
    for step, (g, r) in enumerate(zip(measured["grads"], declared["grads"])):
        assert_same(g, r, f"gradients of step {step}, shape measured vs declared")
    assert_same(measured["weights"], declared["weights"], "weights after 2 steps, shape measured vs declared")


@pytest.mark.filterwarnings("ignore:offload='auto'")
def test_report_says_planned_at_the_first_forward_what_moved_and_refuses_as_declared(runs):
    joint, first = runs["measured"]["joint"], runs["state_first"]["state"]["units"]
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
    assert str(at_forward.value) == str(at_build.value)
