"""``PeerRedundancy``: the options of ``ZeroOptimizer(redundancy="peer" | PeerRedundancy(...))``."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class PeerRedundancy:
    """Keep every committed step's training state in node-local shared memory, with a replica
    on a buddy rank (Note [peer memory tier] in zeroshard/resilience/memory_tier.py)."""

    path: Optional[str] = None
    """Root of the memory tier on this node (a tmpfs directory). None: ``/dev/shm/zeroshard-<run_id>``."""
    every: int = 1
    """Commit to the tier on every ``every``-th step given to ``zeroshard.memory_checkpoint``."""
    run_id: Optional[str] = None
    """Names the run; a tier written under another run id is refused. None: torchrun's
    ``TORCHELASTIC_RUN_ID`` (its ``--rdzv-id``), else "default"."""

    def __post_init__(self) -> None:
        if self.path is not None and not isinstance(self.path, (str, os.PathLike)):
            raise TypeError(f"PeerRedundancy(path={self.path!r}) must be a directory path (a str), e.g. '/dev/shm/run1'")
        if self.path is not None:
            object.__setattr__(self, "path", os.fspath(self.path))
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"PeerRedundancy(every={self.every!r}) must be an int >= 1 (1: every step)")
        if self.run_id is not None and (not isinstance(self.run_id, str) or not self.run_id
                                        or "/" in self.run_id or self.run_id in (".", "..")):
            raise ValueError(f"PeerRedundancy(run_id={self.run_id!r}) must be a non-empty name without '/'")

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


def check_composition(options: Optional[PeerRedundancy], *, nvme: bool, tp: bool, pp: bool, hybrid: bool) -> None:
    """What the tier does not cover yet is refused at construction, not found at recovery."""
    if options is None:
        return
    if nvme:
        raise ValueError("redundancy='peer' keeps the optimizer state in memory; it does not combine with NVMe "
                         "offload (its state streams from files): use offload_optimizer='cpu' or None")
    if tp or pp or hybrid:
        raise ValueError("redundancy='peer' covers one data-parallel shard group; it does not combine with "
                         "tensor, pipeline or hybrid (replicated) meshes yet")
