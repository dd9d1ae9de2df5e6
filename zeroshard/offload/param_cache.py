"""The parameter cache of automatic placement: swapped stage-3 shards that stay in memory
from their unit's forward gather to its backward gather.

Without it a swapped shard is read twice per step, once per gather. The planner
(Note [automatic placement] in zeroshard/planner/auto_placement.py) picks the units whose shards
fit the memory left after placing the state, the last units of forward first (backward
gathers them first, so the memory comes back soonest). Their shards are kept only across a
forward with gradients enabled: an evaluation forward, and every backward gather, drop the
shard as before, and the step still writes it back and releases it. The copy in memory is
always the file's (the step's write and checkpoint loads update both), so keeping it
changes no value, only the reads.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch


class ParamCache:
    def __init__(self, units: Iterable[Any]) -> None:
        self._units = {id(u) for u in units}
        self.units = len(self._units)

    def keep(self, unit: Any, backward: bool) -> bool:
        """Whether the shard just copied into the gathered buffer stays in memory."""
        return not backward and torch.is_grad_enabled() and id(unit) in self._units
