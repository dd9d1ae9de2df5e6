"""``PlannedActivations``: the micro-batch shape ``offload="auto"`` plans activations for
(Note [activations under the budget] in planned.py); apart from the planner, so the config can
check it without importing the planner.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class PlannedActivations:
    """The activations ``offload="auto"`` plans with the state: one micro-batch's shape."""

    micro_batch: int
    """Sequences per forward on this rank."""
    seq_len: int
    """Tokens per sequence."""
    checkpointed: bool = True
    """The model runs its blocks under ``torch.utils.checkpoint(use_reentrant=False)``."""
    prefetch: int = 2
    """As ``ActivationOffload.prefetch``."""

    def __post_init__(self) -> None:
        for name in ("micro_batch", "seq_len", "prefetch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PlannedActivations({name}={value!r}) must be an int >= 1")
        if self.checkpointed is not True:
            raise ValueError(
                "PlannedActivations(checkpointed=False): the plan counts a block's input as what moves, which "
                "holds only for checkpointed blocks; checkpoint the model's blocks (torch.utils.checkpoint, "
                "use_reentrant=False), or choose the blocks by hand: offload_activations=ActivationOffload("
                "where='cpu'|'nvme', blocks=(...))")
