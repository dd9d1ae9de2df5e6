"""``PlannedActivations``: the micro-batch shape ``offload="auto"`` plans activations for, declared
or measured at the first forward (Note [activations under the budget] in planned.py); apart from
the planner, so the config can check it without importing the planner.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True, kw_only=True)
class PlannedActivations:
    """The activations ``offload="auto"`` plans with the state: one micro-batch's shape, declared, or
    (both None, the default) measured at the first forward's first block and planned there."""

    micro_batch: Optional[int] = None
    """Sequences per forward on this rank; None: measured at the first forward."""
    seq_len: Optional[int] = None
    """Tokens per sequence; None: measured at the first forward."""
    checkpointed: bool = True
    """The model runs its blocks under ``torch.utils.checkpoint(use_reentrant=False)`` (their inputs
    move); False: it does not, and a block keeps its saved tensors or moves them all."""
    prefetch: int = 2
    """As ``ActivationOffload.prefetch``."""
    recompute: bool = True
    """``checkpointed=False``: the offloader may run blocks under ``torch.utils.checkpoint`` itself, the
    plan choosing per block keep / move / checkpoint / checkpoint + move (Note [mixed activation plans]
    in zeroshard/planner/activation_mix.py); False: a block keeps its saved tensors or moves them all."""
    inductor_split: bool = False
    """As ``ActivationOffload.inductor_split``."""

    def __post_init__(self) -> None:
        for name in ("micro_batch", "seq_len", "prefetch"):
            value = getattr(self, name)
            if value is None and name != "prefetch":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PlannedActivations({name}={value!r}) must be an int >= 1"
                                 + ("" if name == "prefetch" else ", or None (measured at the first forward)"))
        if (self.micro_batch is None) != (self.seq_len is None):
            raise ValueError(f"PlannedActivations(micro_batch={self.micro_batch!r}, seq_len={self.seq_len!r}): "
                             "declare both, or neither (both measured at the first forward)")
        for name in ("checkpointed", "recompute", "inductor_split"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"PlannedActivations({name}={getattr(self, name)!r}) must be a bool")
