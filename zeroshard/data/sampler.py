"""ResumableSampler: a distributed, shuffled sampler that resumes mid-epoch at any world size.

One global order per epoch (a permutation seeded by ``seed + epoch``, the same on every
rank) is dealt round-robin: global position ``p`` goes to rank ``p % world_size``. The
state is the *global* number of positions consumed in the epoch, so after resuming at a
different world size the remaining positions are dealt to the new ranks and every global
batch (``world_size * batch_size`` consecutive positions) is the one the original run would
have seen, provided the global batch size is kept.

Counting: a position counts as consumed when this sampler yields it. That is exact for a
``DataLoader`` with ``num_workers=0`` (it pulls indices batch by batch); with worker
processes the loader prefetches, so use ``torchdata``'s ``StatefulDataLoader`` (whose
``state_dict()`` accounts for prefetching) over this sampler, and save the loader instead.

Bitwise resume with dropout: a ``DataLoader`` draws its base seed from the global torch RNG
whenever an iterator starts, which a resumed run does at another step than the original;
pass ``generator=torch.Generator()`` to the DataLoader so that draw leaves the global RNG be.
"""
from __future__ import annotations

from typing import Iterator, Optional, Sized, Union

import torch
import torch.distributed as dist


class ResumableSampler(torch.utils.data.Sampler[int]):
    reshardable = True
    """Its state is global, so ``load_checkpoint`` may load it at another world size."""

    def __init__(self, dataset: Union[Sized, int], *, num_replicas: Optional[int] = None,
                 rank: Optional[int] = None, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False) -> None:
        self.dataset_len = dataset if isinstance(dataset, int) else len(dataset)
        initialized = dist.is_available() and dist.is_initialized()
        self.num_replicas = num_replicas if num_replicas is not None else (dist.get_world_size() if initialized else 1)
        self.rank = rank if rank is not None else (dist.get_rank() if initialized else 0)
        if not 0 <= self.rank < self.num_replicas:
            raise ValueError(f"rank={self.rank} is outside num_replicas={self.num_replicas}")
        if self.dataset_len < 0:
            raise ValueError(f"dataset length {self.dataset_len} is negative")
        self.shuffle, self.seed, self.drop_last = shuffle, int(seed), drop_last
        self.epoch = 0
        self.consumed = 0
        """Global positions of this epoch already handed out (by all ranks together)."""

    # -- the order -------------------------------------------------------------------------
    def _order(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            return torch.randperm(self.dataset_len, generator=g).tolist()
        return list(range(self.dataset_len))

    def _total(self) -> int:
        """Positions in this epoch: the dataset, cut or wrapped so every rank gets the same
        count from the current offset on."""
        remaining = max(0, self.dataset_len - self.consumed)
        w = self.num_replicas
        per_rank = remaining // w if self.drop_last else -(-remaining // w)
        return self.consumed + per_rank * w

    def __len__(self) -> int:
        return (self._total() - self.consumed) // self.num_replicas

    def __iter__(self) -> Iterator[int]:
        if self.consumed > 0 and self.consumed >= self._total():
            # A finished epoch rolls over to the next: a run resumed exactly at an epoch's end
            # then sees the data the uninterrupted run saw after set_epoch(epoch + 1).
            self.epoch, self.consumed = self.epoch + 1, 0
        order = self._order()
        total, start = self._total(), self.consumed
        for p in range(start + self.rank, total, self.num_replicas):
            # Every rank advances the shared count by one full round per index it yields.
            self.consumed = p - self.rank + self.num_replicas
            yield order[p % self.dataset_len] if self.dataset_len else 0

    def set_epoch(self, epoch: int) -> None:
        """Starts epoch ``epoch`` from its beginning, unless it is the epoch being resumed."""
        if epoch != self.epoch:
            self.epoch, self.consumed = int(epoch), 0

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed,
                "dataset_len": self.dataset_len, "shuffle": self.shuffle, "drop_last": self.drop_last,
                "num_replicas": self.num_replicas}

    def load_state_dict(self, state: dict) -> None:
        if int(state["dataset_len"]) != self.dataset_len:
            raise ValueError(f"sampler state is for a dataset of {state['dataset_len']} samples, this one "
                             f"has {self.dataset_len}; resume with the same dataset")
        if bool(state["shuffle"]) != self.shuffle or int(state["seed"]) != self.seed:
            raise ValueError(f"sampler state has shuffle={state['shuffle']}, seed={state['seed']}; this "
                             f"sampler has shuffle={self.shuffle}, seed={self.seed}: build it with the same")
        consumed = int(state["consumed"])
        if not 0 <= consumed <= self.dataset_len + int(state.get("num_replicas", 1)):
            raise ValueError(f"sampler state consumed={consumed} is outside the dataset of {self.dataset_len}")
        self.epoch, self.consumed = int(state["epoch"]), consumed
