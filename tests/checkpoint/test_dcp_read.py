"""zeroshard resumes an FSDP2 run from its torch Distributed Checkpoint (torchtitan's layout) at
other world sizes and stages: the state loads exactly and the next step is FSDP2's own."""
from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.support import dcp_worker
from tests.support.asserts import assert_close_named, assert_same
from tests.support.dist_results import run_ranks

STEPS = 3


@pytest.fixture(scope="module")
def fsdp_checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("fsdp")
    run_ranks(dcp_worker.fsdp_run, 2, d, str(d / "ck"), STEPS)
    return str(d / "ck"), torch.load(str(d / "res.pt"), weights_only=True)


def _flat(full: tuple) -> dict[str, torch.Tensor]:
    msd, osd = full
    return {**msd, **{k: v for k, v in osd.items() if k.startswith("state.")}}


@pytest.mark.parametrize("world,stage", [(1, 1), (2, 3), (3, 1)])
def test_zeroshard_resumes_fsdp2_dcp(fsdp_checkpoint, tmp_path, world, stage):
    ck, ref = fsdp_checkpoint
    res = run_ranks(dcp_worker.zs_resume, world, tmp_path, ck, stage, STEPS)
    got = torch.load(str(tmp_path / "res.pt"), weights_only=True)
    assert [r["step"] for r in res] == [STEPS] * world and res[0]["format"] == "dcp"
    # Adam's step is 0-d, as torch.optim keeps it, for the 1-element `gain` too
    assert all(r["step_shapes"] in ([[]], []) for r in res), [r["step_shapes"] for r in res]
    want = _flat(ref["saved"])
    loaded = {k: v.reshape(want[k].shape) for k, v in got["loaded"].items()}
    assert_same(loaded, want, "state loaded from FSDP2's DCP checkpoint")
    assert got["lr"] == ref["lr"]
    after = {k: v.reshape(want[k].shape) for k, v in got["after"].items()}
    # (the gradient sums differ in order between world sizes and engines: not bit for bit)
    assert_close_named(after, _flat(ref["after"]), "the step after resuming", rtol=1e-5, atol=1e-6)
    if world > 1:  # each rank read only the chunks its pieces overlap, not the whole checkpoint
        total = sum(os.path.getsize(os.path.join(ck, f)) for f in os.listdir(ck) if f.endswith(".distcp"))
        assert all(r["bytes_read"] < total for r in res), ([r["bytes_read"] for r in res], total)


def test_dcp_bad_input_is_refused_by_name(fsdp_checkpoint, tmp_path):
    ck, _ = fsdp_checkpoint
    missing, truncated = str(tmp_path / "missing"), str(tmp_path / "truncated")
    shutil.copytree(ck, missing)
    os.remove(os.path.join(missing, "__1_0.distcp"))
    shutil.copytree(ck, truncated)
    path = os.path.join(truncated, "__0_0.distcp")
    os.truncate(path, os.path.getsize(path) // 2)
    cases = [(ck, 9), (missing, 7), (truncated, 7), (ck + "-sgd", 7)]  # (width 9: another model)
    other, gone, short, sgd = run_ranks(dcp_worker.zs_refused, 1, tmp_path, cases)[0]
    assert other["error"] == "CheckpointMismatchError", other
    assert "fc1.weight: checkpoint [7, 15] vs model [9, 15]" in other["text"], other
    assert gone["error"] == "CheckpointCorruptError" and "__1_0.distcp is missing" in gone["text"], gone
    assert short["error"] == "CheckpointCorruptError" and "__0_0.distcp is truncated" in short["text"], short
    assert sgd["error"] == "CheckpointMismatchError" and "dampening" in sgd["text"] and \
        "another optimizer class" in sgd["text"], sgd


def test_torchtitan_style_get_and_set_state_dict_on_a_zero_optimizer(fsdp_checkpoint, tmp_path):
    """dcp.load of FSDP2's checkpoint through torch's own get_state_dict/set_state_dict (stages 2
    and 3) and zeroshard's drop-in (stage 3), world 2; a step, dcp.save, and a fresh optimizer
    loading that back continues bit for bit."""
    ck, ref = fsdp_checkpoint
    runs = [("torch", 3), ("torch", 2), ("zeroshard", 3)]
    run_ranks(dcp_worker.zs_torch_api, 2, tmp_path, ck, str(tmp_path / "again"), runs, STEPS)
    results = torch.load(str(tmp_path / "res.pt"), weights_only=True)
    want = _flat(ref["saved"])
    for api, stage in runs:
        got = results[f"{api}-{stage}"]
        what = f"{api}'s API at stage {stage}"
        assert_same({k: v.reshape(want[k].shape) for k, v in got["loaded"].items()}, want, f"{what}: after dcp.load")
        assert got["lr"] == ref["lr"], (what, got["lr"], ref["lr"])
        after = {k: v.reshape(want[k].shape) for k, v in got["after"].items()}
        assert_close_named(after, _flat(ref["after"]), f"{what}: the step after dcp.load", rtol=1e-5, atol=1e-6)
        assert_same(got["reloaded"], got["after"], f"{what}: a fresh optimizer after dcp.load of its dcp.save")
        assert_same(got["next_reloaded"], got["next"], f"{what}: the next step of the reloaded optimizer")
        # what dcp.save wrote, read whole by torch alone (no zeroshard, no process group): each
        # chunk landed at its global offsets
        plain = {k: torch.empty_like(v) for k, v in got["after"].items() if v.dim()}
        state = {"model": {k: v for k, v in plain.items() if not k.startswith("state.")},
                 "optimizer": {k: v for k, v in plain.items() if k.startswith("state.")}}
        dcp.load(state, checkpoint_id=str(tmp_path / f"again-{api}-{stage}"), no_dist=True)
        assert_same({**state["model"], **state["optimizer"]}, {k: got["after"][k] for k in plain},
                    f"{what}: its dcp.save read back by torch alone")
    # torch's flattened keys are torchtitan's and FSDP2's: the optimizer's groups carry AdamW's options only
    keys = results["torch-3"]["keys"]
    assert "param_groups.fc1.weight.lr" in keys and "state.fc1.weight.exp_avg_sq" in keys, keys[:8]
    assert not [k for k in keys if k.endswith(".adamw_mode")], keys


def test_convert_dcp_both_ways(fsdp_checkpoint, tmp_path):
    """`zeroshard convert-dcp`: FSDP2's DCP to native, that native back to DCP; each loads as
    FSDP2 saved it."""
    ck, ref = fsdp_checkpoint
    res = run_ranks(dcp_worker.zs_convert, 1, tmp_path, ck, str(tmp_path / "native"), str(tmp_path / "dcp"))
    assert res[0]["codes"] == [0, 0]
    assert os.path.isfile(os.path.join(str(tmp_path / "native"), "step-00000003", "manifest.json"))
    assert os.path.isfile(os.path.join(str(tmp_path / "dcp"), "step-00000003", ".metadata"))
    want = _flat(ref["saved"])
    for fmt, got in zip(("native", "dcp"), torch.load(str(tmp_path / "res.pt"), weights_only=True)):
        assert_same({k: v.reshape(want[k].shape) for k, v in got["state"].items()}, want, f"state from {fmt}")
        assert got["lr"] == ref["lr"] and got["step"] == STEPS, (fmt, got["lr"], got["step"])
