"""``CommitPacer``'s arithmetic on a given clock (Note [commit pacing] in
zeroshard/resilience/commit_pacer.py); the pacer on a real tier and process group, with measured
times: tests/dist/test_memory_tier_pacing_and_residuals.py."""
from __future__ import annotations

import pytest

from zeroshard.resilience.commit_pacer import CommitPacer


def test_touched_and_plain_intervals_give_the_cost_and_the_smallest_k_within_budget():
    p = CommitPacer(0.05, 16)
    assert p.measure() is None and p.due(7)  # (nothing measured; the first call commits)
    p.tick(0.0)
    p.started()
    p.committed(0)
    p.tick(1.5)  # touched: the commit started at its first tick
    p.finished(now=1.6)
    p.tick(2.6)  # touched: the thread still ran at its first tick (1.5)
    p.tick(3.6)  # plain
    p.tick(4.6)  # plain
    k, cost, step_s = p.measure()
    assert step_s == pytest.approx(1.0) and cost == pytest.approx(0.6)  # 2.6 s for 2 steps of 1.0 s
    assert k == 12  # 0.6 / 12 = 0.05: the smallest K within 5%
    assert (p.choose(0.05), p.choose(0.0), p.choose(0.051), p.choose(9.0)) == (1, 1, 2, 16)


def test_ranks_adopt_the_largest_proposal_and_probe_until_all_measured():
    p = CommitPacer(0.05, 16)
    assert p.news() is None  # (nothing agreed yet)
    p.agree([None, None])  # the first commit's proposals precede any measurement: the gap stays
    assert (p.every, p.decided) == (4, False)
    p.agree([None, (3, 0.12, 1.0)])  # a rank saw no plain interval yet: a longer gap
    assert (p.every, p.decided) == (8, False)
    p.agree([(3, 0.12, 1.0), (5, 0.22, 0.9)])
    assert (p.every, p.decided, p.cost) == (5, True, 0.22)
    assert p.news() == ("memory tier: committing every 5 step(s): a commit costs 22.0% of a step, 4.4% per step "
                        "(budget 5%, at most every 16)")  # (zeroshard finetune logs it when K changes)
    assert p.news() is None
    p.committed(10)
    assert not p.due(14) and p.due(15)
    p.agree([None, (1, 0.01, 1.0)])  # (decided: an incomplete round keeps the gap)
    assert p.every == 5
    q = CommitPacer(0.05, 6)
    for _ in range(4):
        q.agree([None])
    assert q.every == 6  # (capped by max_every while probing)
