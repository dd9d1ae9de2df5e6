"""The memory tier's pacing (``PeerRedundancy(every="auto")``, the default: Note [commit pacing]
in zeroshard/resilience/commit_pacer.py) and its gradient residuals (error feedback, restored at
a memory recovery: Note [peer memory tier] in zeroshard/resilience/memory_tier.py), on 2 gloo
ranks in one spawn (tests/support/tier_pacing_worker.py)."""
from __future__ import annotations

import shutil
import uuid

import pytest

from tests.support import tier_pacing_worker as tw
from tests.support.dist_results import run_ranks


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    root = f"/dev/shm/zeroshard-test-{uuid.uuid4().hex[:10]}"
    try:
        yield run_ranks(tw.worker, 2, tmp_path_factory.mktemp("pacing"), root)
    finally:
        for case in ("codec", "codec-disk", "slow", "cheap"):
            shutil.rmtree(f"{root}-{case}", ignore_errors=True)


def test_memory_recovery_restores_the_codec_residuals_bitwise(ranks):
    """int8 gradients with error feedback: the recovered run continues bit for bit (before, the
    residuals restarted at zero); rank 1's own slot is gone: its come from rank 0's replica."""
    for r in ranks:
        c = r["codec"]
        assert (c["step"], c["source"]) == (3, "memory")
        assert c["residuals"] and c["nonzero"], "the codec kept no residuals: the check would be vacuous"
        assert c["restored"], "the residuals were not restored from the memory tier"
        assert c["equal"], "the run continued from memory differs from the one that did not fail"


def test_a_rank_and_its_buddy_lost_falls_back_to_the_disk_with_one_line_naming_the_pieces(ranks):
    """Rank 1's own slots and rank 0's replica of them both gone: every rank loads the disk's
    (older) step instead, bitwise, and says once which pieces and why."""
    for r in ranks:
        b = r["codec"]["both_lost"]
        assert b["step"] == 1 and b["equal"], b
        assert len(b["said"]) == 1 and "loading from the disk checkpoint, not the memory tiers" in b["said"][0], b
        assert "step 3: the pieces of rank(s) [1] are in no tier" in b["said"][0], b


def test_auto_pacing_commits_every_kth_step_on_every_rank_and_recovers(ranks):
    """A state large against a tiny step: the measured cost of a commit is more than 5% of a step,
    so K > 1, the same K and the same steps on both ranks; the recovery gives the last committed
    step's state exactly, at most K - 1 steps lost."""
    slow = [r["slow"] for r in ranks]
    assert slow[0]["committed"] == slow[1]["committed"] and slow[0]["gaps"] == slow[1]["gaps"]
    s = slow[0]
    rep = s["report"]
    assert rep["auto"] and rep["decided"] and rep["every"] > 1, rep
    assert rep["commit_cost"] > rep["budget"], rep
    assert rep["every"] == min(rep["max_every"], -(-rep["commit_cost"] // rep["budget"])), rep
    committed, gaps = s["committed"], s["gaps"]
    assert committed[0] == 1
    assert all(b - a == g for a, b, g in zip(committed, committed[1:], gaps)), (committed, gaps)
    assert gaps[-1] > 1 and len(committed) < s["steps"] // 2, (committed, gaps)
    for r in slow:
        assert (r["recovered"], r["source"]) == (committed[-1], "memory") and r["equal"]
        assert s["steps"] - r["recovered"] <= gaps[-1] - 1


def test_auto_pacing_commits_every_step_when_cheap(ranks):
    """A tiny state and a long step: a commit costs under 5% of a step, so every step is committed
    once measured (after the probe's commits at steps 1, 5 and 9)."""
    cheap = [r["cheap"] for r in ranks]
    assert cheap[0]["committed"] == cheap[1]["committed"]
    c = cheap[0]
    assert c["report"]["decided"] and c["report"]["every"] == 1 and c["report"]["commit_cost"] <= 0.05, c["report"]
    # (every step from 10 on; one measurement blown up by a loaded machine may skip one of them
    # before the mean of the last commits brings K back to 1, which the report above asserts)
    assert c["committed"][:3] == [1, 5, 9] and c["committed"][-1] == 12 and len(c["committed"]) >= 5, c["committed"]
    for r in cheap:
        assert (r["recovered"], r["source"], r["equal"]) == (12, "memory", True)


def test_a_rank_lost_before_the_first_disk_save_fails_the_save_at_once(tmp_path):
    """Note [save group made early] in zeroshard/checkpoint/memory_commit.py: the save's side group
    exists from the first commit, so a save after a rank is gone fails on its closed sockets, not
    after the store's timeout (30 s here) in new_group."""
    root = f"/dev/shm/zeroshard-test-{uuid.uuid4().hex[:10]}"
    try:
        d = run_ranks(tw.dead_worker, 2, tmp_path, root)[0]
    finally:
        for r in (root, root + "-disk"):
            shutil.rmtree(r, ignore_errors=True)
    assert d["error"] is not None, d
    assert d["seconds"] < 15, d


def test_parity_groups_turn_the_tier_off_together_when_one_rank_cannot_write(tmp_path):
    """PeerRedundancy(parity=2), rank 1's tmpfs full: every rank learns of it at the commit's gather
    and stops committing at the same step (before, only rank 1 did, and rank 0's next parity
    exchange waited for it until the timeout)."""
    root = f"/dev/shm/zeroshard-test-{uuid.uuid4().hex[:10]}"
    try:
        res = run_ranks(tw.parity_full_worker, 2, tmp_path, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert res[0]["committed"] == res[1]["committed"] == [1], res
    assert all(r["disabled"] and "rank 1" in r["disabled"] for r in res), res
