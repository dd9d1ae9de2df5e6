"""Stage 3 refuses a forward that one rank runs alone (evaluation on rank 0 only).

Note [forward on every rank]: a stage-3 forward gathers every unit from every rank of the
shard group, so all of them must run it. The common mistake is evaluation on one rank
(nanoGPT's ``estimate_loss`` under ``if master_process``): that rank's gathers meet whatever
the other ranks run next -- a barrier (both wait until the collective timeout), or their own
training forward, whose gathers match (the evaluation silently succeeds) until backward's
reductions meet the lone rank's next gathers and gloo aborts on a size mismatch.

Training forwards never need a check (every rank runs them; a rank that skips one is as
broken as without stage 3). So only the first forward of an evaluation -- gradients off or the
model in eval mode, after a training forward or at the start -- agrees with its peers, outside
the process group: each rank sets key ``<prefix>/<k>/<rank>`` in the c10d store (the k-th
evaluation) and waits for its peers' keys for the group's collective timeout. A rank that
evaluates alone gets a RuntimeError saying so before it gathers anything; the others, which
were elsewhere, get the process group's own timeout error from their pending collective
(never a silent mismatch). Cost: one store write and one wait per evaluation, about 1-2 ms
on one host of 2 loaded cores (tests/dist/test_interrupted_steps.py measures it), none per further
evaluation forward and none in training. (An evaluation that all ranks start but one rank
makes longer than the others is not caught: its gathers meet the others' next collectives.)

Note [bounded divergence]: the group's collective timeout is 30 minutes by default, so the
lone rank learned late, and the others -- blocked in their next training forward's gather,
which the lone rank never joins -- learned only the backend's timeout. So a gather waits at
most ``ZEROSHARD_DIVERGENCE_S`` seconds (default 60) before it looks outside the process group:
it records in the store that this rank is stuck in a gather (with its evaluation count), and
if a peer has started an evaluation this rank has not, it raises; otherwise it goes on
waiting, in one-second slices (a peer that is merely slow -- saving, logging -- is never an
error). The evaluating rank waits for its peers in one-second slices too and raises as soon
as a peer reports itself stuck in a gather with fewer evaluations. Both ranks raise the same
error within about the bound plus a second, whatever the group's timeout. Cost: none while
gathers complete within the bound (one timed wait instead of an untimed one).
"""
from __future__ import annotations

import datetime
import itertools
import os
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from zeroshard.comm.process_group import Work

_INSTANCES = itertools.count()  # (every rank builds its optimizers in the same order)


def divergence_bound() -> datetime.timedelta:
    """How long a stage-3 gather waits before it checks whether the ranks diverged (Note [bounded divergence])."""
    return datetime.timedelta(seconds=float(os.environ.get("ZEROSHARD_DIVERGENCE_S", "60")))


_SLICE = datetime.timedelta(seconds=1)


def _diverged(evaluating: list[int], training: list[int], k: int, model: torch.nn.Module,
              bound: datetime.timedelta) -> RuntimeError:
    """The one error every rank raises (Note [bounded divergence])."""
    return RuntimeError(
        f"every rank must run the forward at stage 3; evaluate on all ranks: rank(s) {evaluating} started "
        f"evaluation number {k} (a forward of {type(model).__name__} with gradients off or in eval mode) while "
        f"rank(s) {training} ran another forward and waited {bound.total_seconds():g} s in a parameter gather "
        "that the evaluating rank(s) will not join. Stage 3 gathers every parameter from every rank in each "
        "forward, so run the evaluation (e.g. nanoGPT's estimate_loss) on every rank, and print or log its "
        "result on rank 0 only (ZEROSHARD_DIVERGENCE_S sets how long a gather waits before this check)")


def _timeout(group: Any) -> datetime.timedelta:
    try:  # the group's own collective timeout
        return group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError, ValueError):
        return datetime.timedelta(seconds=float(os.environ.get("ZEROSHARD_PG_TIMEOUT", "1800")))


class ForwardAgreement:
    def __init__(self, comm: Any) -> None:
        self.store: Optional[dist.Store] = None
        instance = next(_INSTANCES)
        group = getattr(comm, "group", None)  # (hpZ's two-level comm: not checked)
        if comm.world_size <= 1 or group is None or not dist.is_initialized():
            return
        try:
            self.store = dist.distributed_c10d._get_default_store()
            self.ranks = dist.get_process_group_ranks(group)
        except (AttributeError, RuntimeError, ValueError):
            self.store = None
            return
        self.rank = dist.get_rank()
        self.timeout = _timeout(group)
        self.prefix = f"zeroshard/forward/{instance}/{'-'.join(map(str, self.ranks))}"
        self.count = 0
        self.bound = divergence_bound()

    def _key(self, k: int, rank: int) -> str:
        return f"{self.prefix}/{k}/{rank}"

    def check(self, model: torch.nn.Module) -> None:
        """Returns once every rank of the group has started its ``count``-th evaluation forward;
        raises naming the ranks that did not within the collective timeout."""
        store = self.store
        if store is None:
            return
        self.count += 1
        k = self.count
        store.set(self._key(k, self.rank), "1")
        peers = [self._key(k, r) for r in self.ranks if r != self.rank]
        deadline = time.monotonic() + self.timeout.total_seconds()
        pause = 0.001
        while not store.check(peers):  # (polled: a timed-out store.wait logs warnings each time)
            time.sleep(pause)
            pause = min(2 * pause, 0.25)
            stuck = [r for r in self.ranks if r != self.rank and _stuck_before(store, self._stuck_key(r), k)]
            if stuck:  # (Note [bounded divergence])
                raise _diverged([r for r in self.ranks if r not in stuck], stuck, k, model, self.bound)
            if time.monotonic() < deadline:
                continue
            missing = [r for r in self.ranks if r != self.rank and not _has(store, self._key(k, r))]
            raise RuntimeError(
                f"every rank must run the forward at stage 3; evaluate on all ranks: rank {self.rank} started a "
                f"forward of {type(model).__name__} with gradients off or in eval mode (evaluation number {k}) "
                f"that rank(s) {missing} did not start within {self.timeout.total_seconds():g} s. Stage 3 gathers "
                "every parameter from every rank in each forward, so run the evaluation (e.g. nanoGPT's "
                "estimate_loss) on every rank, and print or log its result on rank 0 only") from None
        if k > 2:  # every peer has passed evaluation k - 2 (it started k - 1): nobody reads that key
            try:
                store.delete_key(self._key(k - 2, self.rank))
            except (RuntimeError, NotImplementedError):
                pass

    def _stuck_key(self, rank: int) -> str:
        return f"{self.prefix}/stuck/{rank}"

    def wait(self, work: Work, model: torch.nn.Module) -> None:
        """``work.wait()`` for a gather of ``model``'s parameters, bounded: past ``self.bound`` it
        checks, in slices, whether a peer started an evaluation this rank did not (Note
        [bounded divergence])."""
        store = self.store
        works = list(getattr(work, "works", [work]))  # (emulated gathers: one broadcast per rank)
        if store is None or not all(isinstance(w, dist.Work) for w in works):
            work.wait()
            return
        deadline = time.monotonic() + self.bound.total_seconds()
        reported = False
        for w in works:
            while True:
                left = max(deadline - time.monotonic(), 0.001)
                if _waited(w, _SLICE if reported else datetime.timedelta(seconds=left)):
                    break
                if time.monotonic() < deadline:
                    continue
                if not reported:  # (kept when raising: the evaluating rank reads it)
                    store.set(self._stuck_key(self.rank), str(self.count))
                    reported = True
                ahead = [r for r in self.ranks if r != self.rank and _has(store, self._key(self.count + 1, r))]
                if ahead:
                    raise _diverged(ahead, [r for r in self.ranks if r not in ahead], self.count + 1, model,
                                    self.bound)
        if reported:  # (merely slow: no longer stuck)
            try:
                store.delete_key(self._stuck_key(self.rank))
            except (RuntimeError, NotImplementedError):
                pass


def _waited(work: dist.Work, timeout: datetime.timedelta) -> bool:
    """True once ``work`` completed within ``timeout``; False while it is still in flight."""
    try:
        work.wait(timeout)
        return True
    except RuntimeError as exc:
        if "Operation timed out" not in str(exc):  # (Work.wait's own bound; a failed collective is raised)
            raise
        return False


def _stuck_before(store: dist.Store, key: str, k: int) -> bool:
    """The rank of ``key`` reports itself stuck in a gather with fewer than ``k`` evaluations."""
    if not _has(store, key):
        return False
    try:
        return int(store.get(key)) < k
    except (RuntimeError, ValueError):
        return False


def _has(store: dist.Store, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except RuntimeError:
        return False
