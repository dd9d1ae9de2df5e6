"""``CommitPacer``: which steps ``PeerRedundancy(every="auto")`` commits to the memory tier.
Lifecycle: built with the tier -> ``tick`` at every ``memory_checkpoint`` call (the step loop's
clock) -> ``started``/``finished`` around each commit -> ``measure`` (this rank's proposal, sent
with the commit) -> ``agree`` (every rank's proposals, gathered by the commit's thread) ->
``due`` (Note [commit pacing]).

Note [commit pacing]:
What a commit costs. The training loop pays for a commit in wall time: ``memory_checkpoint``'s
own time on the caller's thread (the capture, starting the thread), the next ``opt.step()``'s
wait for the copy, the next commit's wait for the thread, and, where the tier's thread (the
copy with its checksum, the replica) competes with the step for the same cores, the step's own
slowdown. The last one depends on the machine (on two busy cores it dominates; on a GPU node's
spare host cores it is zero), so it is not added from the thread's CPU time (that would charge
a commit for cores the step does not use) but measured where it shows: in the step loop's
clock. Each ``memory_checkpoint`` call is a tick; the interval between two ticks is one step
of the loop. An interval is *touched* when a commit started at its first tick or a commit's
thread was still running at its first tick, *plain* otherwise. A commit's cost is the sum of
the intervals it touched minus as many plain intervals (the median of the last 32 plain
ones: T, robust to a single slow step); its relative cost is cost / T, the fraction of one step
it adds, and c is its mean over the last 8 commits (the mean, not the median: the goal is the
overhead a run pays on average, and commits that meet a busy machine count in it). Committing
every K-th step costs c / K per step, so the pacer proposes the smallest K with c / K <=
``budget`` (5%), clamped to [1, ``max_every``].
Agreement. The ranks must commit the same steps (a recovery needs every owner's slot of one
step). Each commit carries this rank's proposal (made at its tick from the intervals measured
so far) to the commit's thread, which all-gathers it with the write failures it gathers
anyway (no collective added on the caller's thread); the next commit's ``ready`` joins that
thread on every rank and adopts the largest proposal (the slowest rank's cost holds back every
rank: the steps are collectives). The gap after commit n is therefore the one agreed from the
measurements taken at commit n - 1 (the steps given to ``memory_checkpoint`` are the same on
every rank, so the due steps are too). Until every rank has measured a commit and a plain
interval the gap probes: the first call commits, then every 4th step (capped by
``max_every``), doubling while no rank sees a plain interval (a commit whose thread outlasts the
gap). Re-deciding: every commit re-proposes from the newest measurements, so K follows the
step time and the state's size; at K = 1 no interval is plain and T is the last measured one.
"""
from __future__ import annotations

import math
import statistics
import time
from collections import deque
from typing import Optional

PROBE = 4
"""The first gap while the cost is not measured yet (doubles while no plain interval is seen)."""


class CommitPacer:
    def __init__(self, budget: float, max_every: int) -> None:
        self.budget, self.max_every = budget, max_every
        self.every = min(PROBE, max_every)
        """The agreed gap after the next commit (probing until measured)."""
        self.next_due: Optional[int] = None
        """The next step to commit (None: the first call commits)."""
        self.decided = False
        self._agreements = 0
        self._told: Optional[tuple[int, bool]] = None
        self.cost: Optional[float] = None
        """The agreed measured cost of one commit, as a fraction of one plain step (None: not measured yet)."""
        self.step_s: Optional[float] = None
        """The plain step time (T) the cost is measured against, in seconds (this rank's)."""
        self._plain: deque[float] = deque(maxlen=32)
        self._costs: deque[tuple[float, int]] = deque(maxlen=8)
        """(sum of the intervals a commit touched, their count), one per closed commit."""
        self._open: Optional[list] = None
        """[sum, count] of the commit whose intervals are being counted."""
        self._last_tick: Optional[float] = None
        self._started_at_last = False
        self._thread_end: Optional[float] = None
        self._running = False

    # -- the step loop's clock ---------------------------------------------------------------
    def tick(self, now: Optional[float] = None) -> None:
        """A ``memory_checkpoint`` call (before anything it commits): closes the interval since
        the previous call as touched or plain."""
        now = time.monotonic() if now is None else now
        if self._last_tick is not None:
            interval = now - self._last_tick
            running_at_start = self._running or (self._thread_end is not None and self._thread_end > self._last_tick)
            if self._started_at_last or running_at_start:
                if self._open is not None:
                    self._open[0] += interval
                    self._open[1] += 1
            else:
                self._plain.append(interval)
                self._close()
        self._last_tick, self._started_at_last = now, False

    def pause(self) -> None:
        """The loop stops calling ``memory_checkpoint`` for a while (an evaluation, a benchmark's
        block without the tier): the interval up to the next call is not a step and is not counted."""
        self._last_tick = None

    def started(self) -> None:
        """A commit starts at this tick (its thread runs from here)."""
        self._close()
        self._open = [0.0, 0]
        self._started_at_last, self._running, self._thread_end = True, True, None

    def finished(self, now: Optional[float] = None) -> None:
        """The commit's thread is done (called on that thread, as its last act)."""
        self._thread_end, self._running = time.monotonic() if now is None else now, False

    def _close(self) -> None:
        if self._open is not None and self._open[1]:
            self._costs.append((self._open[0], self._open[1]))
        self._open = None

    # -- the decision -------------------------------------------------------------------------
    def measure(self) -> Optional[tuple[int, float, float]]:
        """This rank's proposal from what it measured so far: (K, cost of a commit as a fraction
        of a step, the plain step's seconds), or None while it has no commit and plain interval."""
        if not self._plain or not self._costs:
            return None
        t = statistics.median(self._plain)
        if t <= 0:
            return None
        cost = max(0.0, statistics.fmean((s - n * t) / t for s, n in self._costs))
        return self.choose(cost), cost, t

    def choose(self, cost: float) -> int:
        """The smallest K whose per-step cost (``cost`` / K) is within the budget, in [1, max_every]."""
        return min(self.max_every, max(1, math.ceil(cost / self.budget - 1e-9)))

    def agree(self, proposals: list[Optional[tuple[int, float, float]]]) -> None:
        """Every rank's proposal (the same list on every rank): the gap after the next commit."""
        if all(p is not None for p in proposals):
            worst = max(proposals, key=lambda p: (p[0], p[1]))  # type: ignore[index]
            assert worst is not None  # (narrowed above)
            self.every, self.cost, self.decided = worst[0], worst[1], True
        elif not self.decided and self._agreements:  # (the first commit's proposals precede any measurement)
            self.every = min(self.max_every, self.every * 2)  # still probing: a longer gap lets the thread finish
        self._agreements += 1

    def due(self, step: int) -> bool:
        return self.next_due is None or step >= self.next_due

    def committed(self, step: int) -> None:
        """The next due step after committing ``step`` (with the gap agreed so far)."""
        self.next_due = step + self.every

    def report(self) -> dict:
        """What the tier reports of its pacing (``MemoryTier.report``)."""
        mine = self.measure()
        return {"every": self.every, "decided": self.decided, "commit_cost": self.cost,
                "step_cost": (self.cost / self.every) if self.cost is not None else None,
                "budget": self.budget, "max_every": self.max_every,
                "step_s": mine[2] if mine is not None else None}

    def news(self) -> Optional[str]:
        """A line saying the agreed K and its measured cost when they changed since the last call
        (``zeroshard finetune`` logs it), else None."""
        now = (self.every, self.decided)
        if not self.decided or now == self._told:
            return None
        self._told = now
        cost = self.cost or 0.0
        return (f"memory tier: committing every {self.every} step(s): a commit costs {cost:.1%} of a step, "
                f"{cost / self.every:.1%} per step (budget {self.budget:.0%}, at most every {self.max_every})")
