"""zeroshard writes torch Distributed Checkpoints FSDP2 loads with ``dcp.load`` (torchtitan's
layout): every tensor equal to what zeroshard held; a torn save never looks complete."""
from __future__ import annotations

import os

import pytest
import torch

from tests.support import dcp_worker
from tests.support.asserts import assert_same
from tests.support.dist_results import run_ranks

STEPS = 2


@pytest.mark.parametrize("world,stage", [(4, 3), (2, 2)])
def test_fsdp2_loads_what_zeroshard_saved_as_dcp(tmp_path, world, stage):
    (tmp_path / "zs").mkdir()
    (tmp_path / "fsdp").mkdir()
    res = run_ranks(dcp_worker.zs_save, world, tmp_path / "zs", str(tmp_path / "root"), stage, STEPS)
    step_dir = res[0]["path"]
    assert sorted(os.listdir(tmp_path / "root")) == [os.path.basename(step_dir)]  # (no .tmp- left)
    assert {".metadata", "zeroshard-dcp.json"} <= set(os.listdir(step_dir))
    saved = torch.load(str(tmp_path / "zs" / "res.pt"))
    run_ranks(dcp_worker.fsdp_load, 2, tmp_path / "fsdp", step_dir)
    got = torch.load(str(tmp_path / "fsdp" / "res.pt"))
    want = {k: v.reshape(got["loaded"][k].shape) for k, v in saved["saved"].items()}
    assert_same(got["loaded"], want, "FSDP2's state loaded from zeroshard's DCP checkpoint")
    assert got["lr"] == saved["lr"] and got["step"] == STEPS
