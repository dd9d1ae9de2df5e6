"""Pipeline checkpoints keep each stage's param groups by the names they hold (issue 43, section 2;
Note [param groups by name]): stage 0 with ``[{embedding, lr=1e-5}, {rest}]`` and stage 1 with
``[{rest}]`` resume each at its own learning rate, and the whole model loads in one process
grouped as saved (tests/support/pipeline_groups_worker.py, 2 gloo ranks)."""
from __future__ import annotations

import pytest

from tests.support import pipeline_groups_worker as w
from tests.support.dist_results import run_ranks

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    d = tmp_path_factory.mktemp("pipeline-groups")
    return run_ranks(w.worker, 2, d, str(d / "ckpt"))


def test_each_stage_resumes_with_its_own_groups_options(ranks):
    lr = w.pw.LR
    assert ranks[0]["same_layout_lrs"] == [w.SLOW, lr]
    assert ranks[1]["same_layout_lrs"] == [lr]  # (not stage 0's embedding rate)
    assert all(r["same_layout_equal"] for r in ranks)
    groups = ranks[0]["manifest_groups"]
    assert [(lr_, first) for _, lr_, first in groups] == [
        (w.SLOW, "model.embed_tokens.weight"), (lr, groups[1][2]), (lr, groups[2][2])]
    assert groups[2][2].startswith("model.layers.2.")  # (stage 1's group, saved as its own)


def test_one_process_loads_groups_as_saved_and_refuses_a_merge_with_the_fix(ranks):
    one = ranks[0]["one_process"]
    assert one["step"] == 1 and one["lrs"] == [w.SLOW, w.pw.LR]
    msg = one["one_group"]
    assert "keep them apart" in msg and "'lr'" in msg and "model.embed_tokens.weight" in msg, msg
