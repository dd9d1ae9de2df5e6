"""A placement policy in one file (issue 26: a new policy costs one file, the facade untouched).

``LargestOnHost`` keeps the optimizer state of the largest unit (its fp32 master, gradient
and Adam moments: they live together) in host memory, as ``offload_optimizer="cpu"`` would,
and every other unit's in device memory. Use: ``ZeroOptimizer(model, torch.optim.AdamW,
placement_policy=LargestOnHost)``. On a CPU-only machine host and device are one memory, so
only the decisions differ (tests/offload/test_custom_placement_policy.py checks both)."""
from __future__ import annotations

from zeroshard.config import Placement
from zeroshard.offload.placement import StatePlacement


class LargestOnHost(StatePlacement):
    def of_unit(self, index: int) -> Placement:
        return Placement(optimizer="cpu") if index == self.on_host else Placement()

    @property
    def on_host(self) -> int:
        """The unit whose state is on the host: the first of the largest (by its gradient's bytes)."""
        return max(range(len(self.specs)), key=lambda i: self.specs[i].grad)
