"""offload="auto" at stage 3 with the micro-batch's shape measured (``PlannedActivations()``): the shape is
read from the model's input (its token ids) before stage 3 gathers anything, and the state and the
activations are planned together there, the state (shards included: they move to the swap file, the
parameter cache and the read-ahead with them) re-placed before the first gather (Note [state re-placed at
the first forward] in zeroshard/offload/placement_replan.py). The run then trains under the declared
run's placement with its bits (dropout on); a budget no candidate meets is refused at the first forward
with the declared run's message; shards and moments loaded from a checkpoint before the first forward
move with their values. Before, stage 3 kept the state first and refused the measured shape
where the joint plan trains. An input that gives no shape (no integer (micro-batch, sequence) tensor)
keeps that: state first, the refusal saying why and to declare the shape."""
from __future__ import annotations

import re

from dataclasses import replace
from typing import Optional

import pytest
import torch
from torch import nn

import zeroshard

from zeroshard.offload.activations.plan_at_forward import root_shape
from zeroshard.offload.activations.planned import least_device, shape_of
from zeroshard.offload.activations.workload import PlannedActivations
from zeroshard.testing.toy import TinyGPT, synthetic_batch

from tests.support import act_offload_worker as w
from tests.support.asserts import assert_same

OVER, BUCKET, SEQ = {"seq_len": 128}, 0.02, 128  # (as test_joint_state_activation_plan.py: small units, long inputs)
CFG = replace(w.CFG, activation_checkpointing=True, **OVER)


def _free_disk(exc: BaseException) -> str:
    """The refusal's text with the NVMe directory's free space left out: other processes write to
    the same disk between the two runs (seen: 70.93 vs 70.94 GiB)."""
    return re.sub(r"NVMe \d+(\.\d+)? GiB", "NVMe _ GiB", str(exc))


def _train(budget: int, directory: str, declared: bool, steps: int = 3, planned: bool = True, **kw) -> dict:
    return w.train_planned(budget, directory, planned, steps=steps, declared=declared, shape_over=OVER,
                           bucket_size_mb=BUCKET, stage=3, **kw)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("nvme"))
    roomy = _train(1 << 30, d, True, steps=0)  # (planned at construction: the state's memory, no step)
    state = (1 << 30) - roomy["report"]["plan"]["memory_left"]["device"]
    least = least_device(shape_of(TinyGPT(CFG), CFG.n_layers), PlannedActivations(micro_batch=w.BATCH, seq_len=SEQ),
                         4, {"host": 0})  # (the device bytes of the fully offloaded activation plan)
    budget = state + least - w.BATCH * SEQ * CFG.d_model * 2  # (half an input under it: state first refuses)
    return {"budget": budget, "state": state, "dir": d, "declared": _train(budget, d, True, state_dicts=True),
            "measured": _train(budget, d, False), "state_first": _train(budget, d, True, steps=0, planned=False)}


@pytest.mark.filterwarnings("ignore:offload='auto'")
def test_stage3_measured_shape_trains_under_the_declared_joint_plan_with_its_bits(runs):
    declared, measured = runs["declared"], runs["measured"]
    assert declared["joint"]["chosen"] > 0 and declared["joint"]["sequential_seconds"] is None, declared["joint"]
    assert measured["joint"]["chosen"] == declared["joint"]["chosen"], (measured["joint"], declared["joint"])
    assert measured["report"]["plan"]["blocks"] == declared["report"]["plan"]["blocks"]
    assert measured["state"] == declared["state"], "the state lives where the declared run keeps it"
    assert measured["state"]["applied"]["shard"]["nvme"] > 0, "the joint plan streams stage-3 shards"
    assert any(u["cached"] for u in measured["state"]["units"]), "and caches a streamed shard, as declared"
    assert len(measured["grads"]) == 3
    for step, (g, r) in enumerate(zip(measured["grads"], declared["grads"])):
        assert_same(g, r, f"gradients of step {step}, shape measured vs declared (stage 3)")
    assert_same(measured["weights"], declared["weights"], "weights after 3 steps, shape measured vs declared")


@pytest.mark.filterwarnings("ignore:offload='auto'")
def test_stage3_report_says_planned_at_the_first_forward_what_moved_and_refuses_as_declared(runs):
    joint = runs["measured"]["joint"]
    assert joint["planned"] == "first forward" and joint["re_placed"] and joint["measured_at"] == "input", joint
    want = [{"unit": a["index"], "kind": k, "from": a[k], "to": b[k]}
            for a, b in zip(runs["state_first"]["state"]["units"], runs["declared"]["state"]["units"])
            for k in a if k not in ("index", "cached") and a[k] != b[k]]
    assert any(m["kind"] == "shard" for m in want), want
    assert [{k: m[k] for k in ("unit", "kind", "from", "to")} for m in joint["moved"]] == want
    assert joint["moved_bytes"] == sum(m["bytes"] for m in joint["moved"]) > 0
    # a budget no candidate meets: the joint search's refusal, at the first forward, as at construction
    with pytest.raises(ValueError) as at_build:
        _train(runs["state"], runs["dir"], True, steps=1)
    with pytest.raises(ValueError) as at_forward:
        _train(runs["state"], runs["dir"], False, steps=1)
    assert "the longest sequence that fits is" in str(at_forward.value)
    assert _free_disk(at_forward.value) == _free_disk(at_build.value)


def _resumed(budget: int, directory: str, declared: bool, saved: tuple[dict, dict]) -> dict:
    return w.resumed_planned(budget, directory, declared, saved, OVER, BUCKET, stage=3)


@pytest.mark.filterwarnings("ignore:offload='auto'")
def test_stage3_shards_and_moments_loaded_before_the_first_forward_move_with_their_values(runs):
    saved = runs["declared"]["saved"]  # (after 3 steps under the joint plan)
    declared, measured = (_resumed(runs["budget"], runs["dir"], d, saved) for d in (True, False))
    assert measured["joint"]["re_placed"] and any(m["kind"] == "shard" for m in measured["joint"]["moved"])
    assert measured["units"] == declared["units"]
    assert_same(measured["grads"], declared["grads"], "gradients of the resumed stage-3 step, measured vs declared")
    assert_same(measured["weights"], declared["weights"], "weights after the resumed stage-3 step")


class _Batched(nn.Module):
    """TinyGPT called with a dict: its input names no (micro-batch, sequence) tensor."""

    def __init__(self, model: TinyGPT) -> None:
        super().__init__()
        self.model, self.config = model, model.config

    def forward(self, batch: dict) -> torch.Tensor:
        return self.model(batch["tokens"], batch["targets"])


@pytest.mark.filterwarnings("ignore:offload='auto'")
def test_stage3_input_without_token_ids_keeps_the_state_first_and_says_declare_the_shape(runs):
    """Where the model's input gives no shape, the first block measures it, too late to move shards the
    gatherer is reading: state first, and where that refuses what the joint plan trains (the declared
    run above), the refusal names why and the fix."""
    torch.manual_seed(0)
    model = _Batched(TinyGPT(CFG))
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=3, offload="auto",
                                  memory_budget={"host": runs["budget"], "reserve": 0}, nvme_path=runs["dir"],
                                  offload_activations=zeroshard.PlannedActivations(), bucket_size_mb=BUCKET)
    try:
        x, y = synthetic_batch(0, w.BATCH, CFG)
        with pytest.raises(ValueError) as refused:
            model({"tokens": x, "targets": y})
        why = opt.placement_report()["joint"]
    finally:
        opt.close()
    text = str(refused.value)
    assert "the longest sequence that fits is" in text and "the state was not planned with the activations" in text
    assert "declare the shape, PlannedActivations(micro_batch=..., seq_len=...)" in text, text
    assert not why["re_placed"] and "measured at the model's input" in why["why"], why


@pytest.mark.parametrize("args,kwargs,want", [
    ((torch.zeros(4, 16, dtype=torch.long),), {}, (4, 16)),  # (TinyGPT: token ids first)
    ((), {"input_ids": torch.zeros(2, 8, dtype=torch.int32), "labels": None}, (2, 8)),  # (Hugging Face)
    ((torch.zeros(4, 16),), {}, None),  # (floats: not token ids)
    ((torch.zeros(16, dtype=torch.long),), {}, None),  # (no micro-batch dimension)
    (({"tokens": torch.zeros(4, 16, dtype=torch.long)},), {}, None),
])
def test_root_shape_reads_token_ids(args: tuple, kwargs: dict, want: Optional[tuple[int, int]]):
    assert root_shape(args, kwargs) == want
