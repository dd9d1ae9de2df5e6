"""A refusal or failure on one rank reaches every rank as the same clear error (issue 43),
on 2 gloo ranks (tests/support/rank_agreement_worker.py; Note [agreed construction])."""
from __future__ import annotations

import pytest

from tests.support import rank_agreement_worker as w
from tests.support.dist_results import run_ranks


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    d = tmp_path_factory.mktemp("agree")
    return run_ranks(w.worker, 2, d, str(d))


def test_construction_refused_on_one_rank_is_refused_on_every_rank(ranks):
    """Rank 1's nvme_path is a regular file: both ranks raise one error naming rank 1 and
    nvme_path (rank 0 used to return a working optimizer and die in its first collective), both
    models are as they were, and the ranks are still in step."""
    seen = [r["construction"] for r in ranks]
    for s in seen:
        assert s["raised"] == "FileNotFoundError", s
        assert "refused on rank 1" in s["message"] and "nvme_path=" in s["message"], s
        assert s["model_restored"] and s["in_step"], s
    assert seen[0]["message"] == seen[1]["message"]


def test_pipeline_stage_count_is_checked_against_the_mesh_when_built(ranks):
    """PipelineStage(num_stages=3) on a pp=2 mesh is refused at construction (it used to abort
    the process inside gloo at the schedule's first step), with or without a ZeroOptimizer."""
    for r in ranks:
        p = r["pipeline"]
        for case in ("plain", "with_optimizer"):
            assert p[case]["raised"] == "ValueError", p
            assert "num_stages=3" in p[case]["message"] and "2 ranks" in p[case]["message"], p
        assert p["in_step"], p


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_rank0_only_save_of_a_sharded_state_dict_is_told_at_save_time(ranks, stage):
    """torch.save(opt.state_dict()) from rank 0 alone warns at save (ShardOnlySaveWarning, naming
    the fix); every rank saving its own file, a consolidated dict saved on rank 0 and an
    in-memory copy say nothing and load back (Note [rank-only state dicts])."""
    for rank, r in enumerate(ranks):
        s = r["save"][str(stage)]
        if rank == 0:
            assert len(s["rank0_only_warned"]) == 1 and "save_checkpoint" in s["rank0_only_warned"][0], s
            assert s["consolidated_warned"] == [], s
        assert s["own_file_warned"] == [] and s["own_file_loads"]["raised"] is None, s
        assert s["deepcopy_loads"]["raised"] is None and s["in_step"], s


def test_ddp_idiom_load_is_refused_on_every_rank_alike(ranks):
    """Rank 0 saved {model, optimizer}.state_dict(), every rank loads (stage 2): both ranks raise
    the same ValueError naming the lone save (rank 0 used to load its own shard and die in its
    next collective with "Connection closed by peer"), and they are still in step."""
    seen = [r["ddp_idiom"] for r in ranks]
    for s in seen:
        assert s["raised"] == "ValueError" and "saved with torch.save by rank 0 alone" in s["message"], s
        assert s["in_step"], s
    assert seen[0]["message"] == seen[1]["message"]


def test_ddp_idiom_at_stage3_is_refused_on_every_rank_alike(ranks):
    """The same at stage 3, where model.state_dict() holds pieces: rank 0's torch.save used to
    raise, leaving rank 1 in the script's barrier to die with "Connection closed by peer"; now the
    save warns and both ranks refuse the file's model weights with one ValueError naming the fix
    (Note [saving pieces]), still in step."""
    seen = [r["ddp_idiom_stage3"] for r in ranks]
    for s in seen:
        assert s["raised"] == "ValueError" and "zeroshard.full_state_dict(model)" in s["message"], s
        assert "by rank 0" in s["message"] and s["in_step"], s
    assert seen[0]["message"] == seen[1]["message"]


def test_rank0_only_evaluation_at_stage3_fails_every_rank_within_the_bound(tmp_path):
    """nanoGPT's estimate_loss under master_process at stage 3, ZEROSHARD_DIVERGENCE_S=2: rank 0
    (evaluating) and rank 1 (blocked in its training forward's gather) raise the same error
    within seconds (Note [bounded divergence]); before, both waited for the group's timeout
    (120 s in the tests, 30 minutes by default)."""
    seen = run_ranks(w.divergence_worker, 2, tmp_path, str(tmp_path))
    for s in seen:
        assert s["raised"] == "RuntimeError" and "evaluate on all ranks" in s["message"], s
        assert "rank(s) [0] started evaluation number 1" in s["message"], s
        assert s["seconds"] < 30, s
    assert seen[0]["message"] == seen[1]["message"]
