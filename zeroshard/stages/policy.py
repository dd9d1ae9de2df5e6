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

    @property
    def gather_after_step(self) -> bool:
        """Each rank updated only its slice, so the others must be fetched."""
        return self.shard_optimizer


_POLICIES = {
    0: StagePolicy(0, shard_optimizer=False, shard_gradients=False),
    1: StagePolicy(1, shard_optimizer=True, shard_gradients=False),
    2: StagePolicy(2, shard_optimizer=True, shard_gradients=True),
}


def policy_for_stage(stage: int) -> StagePolicy:
    if stage not in _POLICIES:
        raise ValueError(f"stage={stage!r} has no flat-unit policy; stages 0, 1, 2 do")
    return _POLICIES[stage]
