"""What each ZeRO stage keeps whole and what it shards.

Stages 0-2 differ only in *where* state lives, so they are data, not subclasses: the
flat units, the gradient reducer and the sharded optimizer read these three answers.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StagePolicy:
    stage: int
    shard_optimizer: bool
    """Master weights and optimizer state exist only for the rank's slice (stage >= 1)."""
    shard_gradients: bool
    """Reduced gradients are kept only for the rank's slice; the full bucket is freed as
    soon as it is reduced (stage >= 2)."""
    shard_parameters: bool = False
    """Only the owned slice of each unit's parameters persists; the full unit is gathered
    around its module's forward and backward and released after (stage 3)."""

    @property
    def gather_after_step(self) -> bool:
        """Each rank updated only its slice, so the others must be fetched (stage 3 fetches
        on demand instead, just before a unit is used)."""
        return self.shard_optimizer and not self.shard_parameters


_POLICIES = {
    0: StagePolicy(0, shard_optimizer=False, shard_gradients=False),
    1: StagePolicy(1, shard_optimizer=True, shard_gradients=False),
    2: StagePolicy(2, shard_optimizer=True, shard_gradients=True),
    3: StagePolicy(3, shard_optimizer=True, shard_gradients=True, shard_parameters=True),
}


def policy_for_stage(stage: int) -> StagePolicy:
    if stage not in _POLICIES:
        raise ValueError(f"stage={stage!r} is not a ZeRO stage; use 0, 1, 2 or 3")
    return _POLICIES[stage]
