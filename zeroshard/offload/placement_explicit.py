"""The explicit options' placement: ``offload_optimizer`` / ``offload_params`` (None, "cpu" or
"nvme", read by the config as a ``Tier``) give every unit the same ``Placement``.

Lifecycle: as ``StatePlacement`` (zeroshard/offload/placement.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from zeroshard.config import Placement
from zeroshard.offload.placement import FrozenUnit, StatePlacement, UnitLayouts
from zeroshard.planner.auto_placement import Fixed, Plan, plan_explicit
from zeroshard.units.tier import Tier

if TYPE_CHECKING:  # (types only: the runs and units are built after the placement)
    from zeroshard.offload.unit_swap import NvmeUnitStore
    from zeroshard.units.flat_unit import FlatUnit
    from zeroshard.units.run import Run


class ExplicitPlacement(StatePlacement):
    def _placed_frozen(self, frozen_units: Sequence[FrozenUnit]) -> Sequence[FrozenUnit]:
        return ()  # (the frozen units go where offload_params puts every shard)

    def _decide(self, fixed: Fixed, optimizer_class: type, layouts: UnitLayouts,
                param_dtype: torch.dtype, groups: Sequence[dict]) -> Plan:
        config = self.config
        return plan_explicit(self.specs, fixed, accelerator=self.accelerator, optimizer=config.optimizer_tier,
                             params=config.params_tier,
                             options=f"offload_optimizer={config.offload_optimizer!r}, "
                                     f"offload_params={config.offload_params!r}")

    def _swap_file_needed(self) -> bool:
        return self.config.optimizer_tier is Tier.NVME

    def _shards_swapped(self) -> bool:
        return self.config.params_tier is Tier.NVME

    @property
    def streams_optimizer(self) -> bool:
        """``offload_optimizer="nvme"``."""
        return self.config.optimizer_tier is Tier.NVME

    @property
    def optimizer_on_host(self) -> bool:
        return self.config.optimizer_tier is Tier.HOST

    def of_unit(self, index: int) -> Placement:
        return self.config.placement

    def of_frozen(self, index: int) -> Placement:
        """``offload_params``, as every trainable shard."""
        return self.config.placement

    def adopt_frozen(self, unit: FlatUnit) -> None:
        """Hands a frozen unit's shard to the swap file under ``offload_params="nvme"``."""
        if self.store is not None and self.config.params_tier is Tier.NVME:
            self.store.adopt(unit)

    def _hand_over(self, store: NvmeUnitStore, unit: FlatUnit, index: int) -> None:
        store.adopt(unit)  # (every part the options put in the swap file)

    def _state_options(self, runs: Sequence[Run]) -> dict:
        return {}  # (every run's moments where offload_optimizer puts them; the pool kept)
