"""``PeerRedundancy``: the options of ``ZeroOptimizer(redundancy="peer" | PeerRedundancy(...))``."""
from __future__ import annotations

import os
from dataclasses import dataclass
from enum import Enum
from typing import Optional, Union


class Pacing(str, Enum):
    """``PeerRedundancy(every=...)`` given as a word: parsed once, here (Note [commit pacing])."""

    AUTO = "auto"


def pacing(every: object) -> "int | Pacing":
    """``every`` as an int >= 1 or a ``Pacing``; ValueError naming the accepted values."""
    if isinstance(every, str):
        try:
            return Pacing(every)
        except ValueError:
            pass
    elif not isinstance(every, bool) and isinstance(every, int) and every >= 1:
        return every
    raise ValueError(f"every={every!r} must be 'auto' or an int >= 1 (1: every step)")


@dataclass(frozen=True)
class PeerRedundancy:
    """Keep every committed step's training state in node-local shared memory, with a replica
    on a buddy rank (Note [peer memory tier] in zeroshard/resilience/memory_tier.py)."""

    path: Optional[str] = None
    """Root of the memory tier on this node (a tmpfs directory). None: ``/dev/shm/zeroshard-<run_id>``."""
    every: Union[int, str] = "auto"
    """Commit to the tier on every ``every``-th step given to ``zeroshard.memory_checkpoint``;
    "auto": every step while a commit costs the step loop at most ``auto_budget`` of a step, else
    every K-th with the smallest K that does, measured and re-decided as it trains, the same K on
    every rank (Note [commit pacing] in zeroshard/resilience/commit_pacer.py)."""
    max_every: int = 16
    """With ``every="auto"``: the largest K it may choose (the most steps a recovery may lose, minus one)."""
    auto_budget: float = 0.05
    """With ``every="auto"``: the share of a step a commit may cost per step (0.05: 5%)."""
    run_id: Optional[str] = None
    """Names the run; a tier written under another run id is refused. None: torchrun's
    ``TORCHELASTIC_RUN_ID`` (its ``--rdzv-id``), else "default"."""
    parity: Optional[int] = None
    """None: each rank's slot is replicated whole to a buddy rank (1x the shard per rank). g >= 2:
    XOR parity over groups of g ranks instead, 1/(g - 1) of the shard per rank; one lost member
    per group is rebuilt from memory (Note [parity memory tier] in zeroshard/resilience/parity.py).
    g must divide the world size."""

    def __post_init__(self) -> None:
        if self.path is not None and not isinstance(self.path, (str, os.PathLike)):
            raise TypeError(f"PeerRedundancy(path={self.path!r}) must be a directory path (a str), e.g. '/dev/shm/run1'")
        if self.path is not None:
            object.__setattr__(self, "path", os.fspath(self.path))
        try:
            object.__setattr__(self, "every", pacing(self.every))
        except ValueError as exc:
            raise ValueError(f"PeerRedundancy({exc}") from None
        if isinstance(self.max_every, bool) or not isinstance(self.max_every, int) or self.max_every < 1:
            raise ValueError(f"PeerRedundancy(max_every={self.max_every!r}) must be an int >= 1 (the largest "
                             "K every='auto' may choose)")
        if isinstance(self.auto_budget, bool) or not isinstance(self.auto_budget, (int, float)) \
                or not 0 < self.auto_budget < 1:
            raise ValueError(f"PeerRedundancy(auto_budget={self.auto_budget!r}) must be a fraction of a step in "
                             "(0, 1), e.g. 0.05")
        if self.parity is not None and (isinstance(self.parity, bool) or not isinstance(self.parity, int)
                                        or self.parity < 2):
            raise ValueError(f"PeerRedundancy(parity={self.parity!r}) must be None (a replica per rank) or an int "
                             ">= 2: the ranks per XOR parity group, dividing the world size (e.g. 4)")
        if self.run_id is not None and (not isinstance(self.run_id, str) or not self.run_id
                                        or "/" in self.run_id or self.run_id in (".", "..")):
            raise ValueError(f"PeerRedundancy(run_id={self.run_id!r}) must be a non-empty name without '/'")

    @property
    def paced(self) -> bool:
        """``every="auto"``: the steps committed are chosen by measurement (Note [commit pacing])."""
        return isinstance(self.every, Pacing)

    @property
    def resolved_run_id(self) -> str:
        return self.run_id or os.environ.get("TORCHELASTIC_RUN_ID") or "default"

    @property
    def root(self) -> str:
        """The tier's directory on this node."""
        return self.path if self.path is not None else os.path.join("/dev/shm", f"zeroshard-{self.resolved_run_id}")


def redundancy_options(value: object) -> Optional[PeerRedundancy]:
    """``redundancy=`` as given (None, "peer" or a PeerRedundancy) -> the options, or None."""
    if value is None or isinstance(value, PeerRedundancy):
        return value
    if value == "peer":
        return PeerRedundancy()
    raise ValueError(f"redundancy={value!r} is not supported; use None, 'peer' or "
                     "zeroshard.PeerRedundancy(path=..., every=...)")


def check_composition(options: Optional[PeerRedundancy], *, nvme: bool, tp: bool, pp: bool, hybrid: bool,
                      world: Optional[int] = None) -> None:
    """What the tier does not cover yet is refused at construction, not found at recovery."""
    if options is None:
        return
    if options.parity is not None and world is not None and (world % options.parity or world < options.parity):
        fits = [d for d in range(2, world + 1) if world % d == 0]
        raise ValueError(f"PeerRedundancy(parity={options.parity}) needs a world size divisible by it, and this "
                         f"shard group has {world} ranks: use parity= one of {fits} (groups of that many ranks)"
                         if fits else f"PeerRedundancy(parity={options.parity}) needs at least 2 ranks in the shard "
                         f"group, and it has {world}: use parity=None")
    if nvme:
        raise ValueError("redundancy='peer' keeps the optimizer state in memory; it does not combine with NVMe "
                         "offload (its state streams from files): use offload_optimizer='cpu' or None")
    if tp or pp or hybrid:
        raise ValueError("redundancy='peer' covers one data-parallel shard group; it does not combine with "
                         "tensor, pipeline or hybrid (replicated) meshes yet")
