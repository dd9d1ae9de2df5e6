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
"""
from __future__ import annotations

import datetime
import itertools
import os
from typing import Any, Optional

import torch
import torch.distributed as dist

_INSTANCES = itertools.count()  # (every rank builds its optimizers in the same order)


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
        try:
            store.wait(peers, self.timeout)
        except RuntimeError:  # (torch's DistStoreError on timeout)
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


def _has(store: dist.Store, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except RuntimeError:
        return False
