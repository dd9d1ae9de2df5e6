"""``offload="auto"``'s placement: each unit's state placed in memory or on NVMe by the
planner's plan under ``memory_budget`` (Note [automatic placement] in
zeroshard/planner/auto_placement.py), the step's peak memory measured against it (``StepPeaks``)
and the parameter cache sized from what step 1 left free.

Lifecycle: as ``StatePlacement`` (zeroshard/offload/placement.py), which it extends with the plan.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch

from zeroshard.config import Placement
from zeroshard.offload.param_cache import ParamCache
from zeroshard.offload.peak_memory import StepPeaks, cache_within, resident_bytes, return_freed_memory
from zeroshard.offload.placement import (FrozenUnit, JointActivations, StatePlacement, UnitLayouts, _PendingCache,
                                        largest_parts, live_units)
from zeroshard.planner.auto_placement import KINDS, Fixed, MemoryBudget, Plan, plan_auto
from zeroshard.offload.activations.workload import PlannedActivations
from zeroshard.offload.placement_replan import gradients_exist, moves, re_place, same_layout, stage3_blocker
from zeroshard.planner.joint_plan import plan_joint, state_candidates
from zeroshard.units.elementwise import update_kind
from zeroshard.units.tier import Tier

if TYPE_CHECKING:  # (types only: the runs and units are built after the placement)
    from zeroshard.offload.unit_swap import NvmeUnitStore
    from zeroshard.stages.stage3.gatherer import ParameterGatherer
    from zeroshard.units.flat_unit import FlatUnit
    from zeroshard.units.run import Run


class AutoPlacement(StatePlacement):
    def _placed_frozen(self, frozen_units: Sequence[FrozenUnit]) -> Sequence[FrozenUnit]:
        # (offload="auto" places the frozen units too, after the trainable ones: a LoRA base past
        # memory streams like any shard)
        return frozen_units

    def _decide(self, fixed: Fixed, optimizer_class: type, layouts: UnitLayouts,
                param_dtype: torch.dtype, groups: Sequence[dict]) -> Plan:
        config, specs = self.config, self.specs
        budget = MemoryBudget.parse(config.memory_budget)
        if not self.accelerator and budget.device and budget.host:
            raise ValueError(
                f"memory_budget={config.memory_budget!r} gives device and host budgets, but the model is on the "
                f"CPU: device and host are one memory here, so a host budget of its own ({budget.host} bytes) "
                f"could not be kept apart from the device's. Give one size, the whole memory this rank may use: "
                f"memory_budget={{'host': ...}} (or on a GPU machine, with the model on the GPU, both)")
        # (Note [freed memory goes back] in peak_memory.py: the largest block backward frees
        # and allocates again is a parameter's gradient, in the model dtype)
        return_freed_memory(torch.empty((), dtype=param_dtype).element_size()
                            * max((seg.numel for layout, _ in layouts for seg in layout.segments), default=0))
        # Measured: plus 2% of the budget for what start-up cannot see (the batch's
        # activations, I/O timing); step 1 then sizes the parameter cache (StepPeaks).
        host_budget = budget.host if self.accelerator else budget.device + budget.host
        share = 0 if budget.reserve is not None else 50  # (the 2%: 1/50 of the budget)
        margin = host_budget // share if share else 0
        process = budget.reserve if budget.reserve is not None else outside_state(groups) + margin
        fixed = dataclasses.replace(fixed, host=fixed.host + process, process=process, budget_share=share,
                                    share_bytes=margin)
        group = fixed.group if config.max_live_units is None else 0
        self._search = (budget, fixed, group)  # (the joint search at the first forward runs with them again)
        if self.joint_activations is None:
            plan = plan_auto(specs, budget, fixed, accelerator=self.accelerator,
                             nvme=config.nvme_path is not None, deeper=group)
        else:  # (a declared micro-batch: state and activations together, Note [joint state and activation plan])
            joint = plan_joint(state_candidates(specs, budget, fixed, accelerator=self.accelerator,
                                                nvme=config.nvme_path is not None, deeper=group),
                               self.joint_activations)
            plan = dataclasses.replace(joint.state, reasons=joint.state.reasons + (joint.reason(),))
            self.joint = {**joint.report(), "planned": "construction"}
        self.live_units = live_units(config, 3 if plan.deeper else None)
        # (whole-tensor classes stream state of their own: Note [generic state on NVMe])
        streamable = [c for c in {g.get("optimizer_class", optimizer_class) for g in groups}
                      if not (isinstance(c, type) and issubclass(c, (torch.optim.Adam, torch.optim.AdamW)))
                      and update_kind(c) != "whole"]
        cls = streamable[0] if streamable else optimizer_class
        self.re_place_blocker = self._blocker(optimizer_class, groups)
        if plan.offloads and streamable:
            raise ValueError(
                f"offload='auto' must offload part of the state to fit memory_budget ({budget}), and offloaded "
                f"state is stepped by the fused Adam/AdamW kernel, which {getattr(cls, '__name__', cls)} does not "
                f"run on; use torch.optim.Adam/AdamW, or a budget that holds everything (at least "
                f"{fixed.device + fixed.host + sum(u.size(k) for u in specs for k in KINDS)} bytes here)")
        self.peaks = StepPeaks(host_budget, calibrate=budget.reserve is None, fit_cache=self._fit_cache,
                               margin=host_budget // 50 + largest_parts(specs))
        return self._cache_until_step1(plan, self.peaks)

    def _cache_until_step1(self, plan: Plan, peaks: StepPeaks) -> Plan:
        """``plan`` with its parameter cache empty until step 1's measured peak sizes it (when the
        peaks are calibrated), the planned cache kept for then."""
        self._planned_cache = plan.cached
        if peaks.calibrate and peaks.works and plan.cached:  # sized after step 1
            plan = cache_within(plan, self._planned_cache, 0,
                                "parameter cache: empty until step 1, whose measured peak sizes it")
        return plan

    def _blocker(self, optimizer_class: type, groups: Sequence[dict]) -> Optional[str]:
        """Why the state placed now will not be placed again with the activations at the first forward
        (Note [state re-placed at the first forward] in placement_replan.py); None: it may be."""
        config, wanted = self.config, self.config.offload_activations
        if not isinstance(wanted, PlannedActivations):
            return "no activation plan (offload_activations is not PlannedActivations)"
        if wanted.micro_batch is not None:
            return "the micro-batch's shape is declared: planned with the state at construction"
        classes = {g.get("optimizer_class", optimizer_class) for g in groups}
        why = ("with an accelerator the joint search gives up device memory by moving shards to host memory "
               "(stage 3) or has no candidate but the state-first plan (stages 1-2), and a re-placement does not "
               "move a shard off the device it was built on: state first" if self.accelerator
               else "without nvme_path no state can give up memory for the activations" if config.nvme_path is None
               else "the fused Adam kernel is off (fused_adam=False)" if not config.fused_adam
               else None)
        if why is None and not all(isinstance(c, type) and issubclass(c, (torch.optim.Adam, torch.optim.AdamW))
                                   for c in classes):
            why = "an optimizer class other than Adam/AdamW: its state does not stream through the fused kernel"
        return why

    def plan_at_first_forward(self, gatherer: Callable[[], ParameterGatherer], activations: JointActivations,
                              at_root: bool) -> Optional[str]:
        """The micro-batch's shape was measured at the first forward (``at_root``: from the model's
        input, before stage 3's ``gatherer()`` gathers anything; else at the first block): the state's
        placement and the activations planned together as with a declared shape, and the state moved to
        that placement before any block runs (Note [state re-placed at the first forward] in
        placement_replan.py); the refusal of the joint search (naming what fits) where no candidate's
        activations fit. Returns why the state stays where it was placed (None: planned jointly)."""
        why = self.re_place_blocker or gradients_exist(self._units) or (
            stage3_blocker(gatherer(), at_root) if self.shards_parameters else None)
        if why is not None:
            self.joint = {"planned": "first forward", "re_placed": False, "why": why}
            return why
        budget, fixed, group = self._search
        built = self.plan
        one_rank = not self.shards_parameters or gatherer().comm.world_size == 1
        candidates = [c for c in state_candidates(self.specs, budget, fixed, accelerator=self.accelerator,
                                                  nvme=True, deeper=group) if self._movable(c, built, one_rank)]
        joint = plan_joint(candidates, activations)
        new = dataclasses.replace(joint.state, reasons=joint.state.reasons + (joint.reason(),))
        moved = moves(built, new)
        if moved:
            if self.store is None or self.swapper is None:  # (built for it: _swap_file_needed, streams_optimizer)
                raise RuntimeError(f"offload='auto': the state moves at the first forward ({len(moved)} part(s)), "
                                   f"but its swap file ({self.store}) or moments' stream ({self.swapper}) was not built")
            re_place(self._units, self._index, self._runs, self.store, self.swapper, new)
            new = dataclasses.replace(new, reasons=new.reasons + (
                f"placed again at the first forward, with the measured micro-batch: {len(moved)} part(s) moved "
                "(Note [state re-placed at the first forward])",))
        if self.shards_parameters:  # (the parameter cache and the read-ahead too)
            new = self._gathered_as(new, gatherer())
        self.plan = new
        self.joint = {**joint.report(), "planned": "first forward", "re_placed": bool(moved), "moved": moved,
                      "moved_bytes": sum(m["bytes"] for m in moved), "measured_at": "input" if at_root else "block"}
        return None

    def _gathered_as(self, plan: Plan, gatherer: ParameterGatherer) -> Plan:
        """Stage 3 re-placed: the parameter cache and ``gatherer``'s read-ahead become ``plan``'s (the
        cache empty until step 1 where the peak is calibrated, as at construction)."""
        if self.peaks is not None:
            plan = self._cache_until_step1(plan, self.peaks)
        if self.store is not None:
            self.store.cache = ParamCache([self._units[i] for i in sorted(plan.cached)]) if plan.cached else None
        self.live_units = gatherer.max_live = live_units(self.config, 3 if plan.deeper else None)
        return plan

    def _movable(self, plan: Plan, built: Plan, one_rank: bool) -> bool:
        """A re-placement can take the state from ``built`` to ``plan``: at stages 1-2 the same shards,
        cache and read-ahead; at stage 3 anything, but the read-ahead only on one rank (each rank measures
        its own micro-batch, and a read-ahead depth differing across ranks would order the gathers'
        collectives differently around the reductions)."""
        if not self.shards_parameters:
            return same_layout(plan, built)
        return one_rank or plan.deeper == built.deeper

    @property
    def _re_placeable(self) -> bool:
        """The structure a re-placement needs is built (Note [state re-placed at the first forward])."""
        return self.re_place_blocker is None

    @property
    def _shards_move(self) -> bool:
        """A re-placement at the first forward may move stage-3 shards (between host memory and the
        swap file: re-placeable at stage 3 means no accelerator), so every shard is laid out as a
        swapped one (4096-aligned for O_DIRECT: Note [aligned swap parts]) from construction."""
        return self._re_placeable and any(u.shard for u in self.specs)

    def _swap_file_needed(self) -> bool:
        return self._re_placeable or any(self.plan.swapped(i) for i in range(len(self.specs)))

    def _shards_swapped(self) -> bool:
        return self._shards_move or any("shard" in self.plan.swapped(i) for i in range(len(self.specs)))

    @property
    def streams_optimizer(self) -> bool:
        """A plan that offloads anything streams the moments (as ``offload_optimizer="nvme"``), and so
        does one that may be placed again at the first forward (every run resident until then)."""
        return self.plan.offloads or self._re_placeable

    @property
    def optimizer_on_host(self) -> bool:
        return False  # (what the plan offloads, it streams: ``streams_optimizer``)

    def of_unit(self, index: int) -> Placement:
        if not self.plan.offloads and not self._re_placeable:
            return Placement()
        if not self.specs[index].shard:
            return Placement(optimizer=Tier.NVME, params=Tier.DEVICE)
        return Placement(optimizer=Tier.NVME, params=Tier.NVME if self._shards_move else self.plan.tier(index, "shard"))

    def of_frozen(self, index: int) -> Placement:
        """The plan's tier for the frozen unit's shard."""
        i = self._frozen_index(index)
        if i is None or not (self.plan.offloads or self._shards_move):
            return Placement()
        return Placement(params=Tier.NVME if self._shards_move else self.plan.tier(i, "shard"))

    def _frozen_index(self, index: int) -> Optional[int]:
        i = sum(1 for u in self.specs if not u.frozen) + index
        return i if i < len(self.specs) and self.specs[i].frozen else None

    def adopt_frozen(self, unit: FlatUnit) -> None:
        """Hands a frozen unit's shard to the swap file where the plan streams it."""
        i = self._frozen_index(sum(1 for u in self._units if u.frozen))
        if i is None:
            return
        self._index[id(unit)] = i
        self._units.append(unit)
        if self.store is None:
            return
        if self.plan.tier(i, "shard") == Tier.NVME:
            self.store.adopt(unit, ("shard",))
        if isinstance(self.store.cache, _PendingCache) and i in self.store.cache.indices:
            self.store.cache.units.append(unit)

    def _hand_over(self, store: NvmeUnitStore, unit: FlatUnit, index: int) -> None:
        if self.plan.swapped(index):
            store.adopt(unit, [p for p in self.plan.swapped(index) if p != "master" or unit.separate_master])

    def _state_options(self, runs: Sequence[Run]) -> dict:
        """The runs whose moments the plan keeps in memory; the pool lives only during the step
        (the parameter cache uses that memory in between)."""
        tier = self.plan.tier
        self._runs = list(runs)
        return {"resident": {id(r.tensor) for r in runs if tier(self._index[id(r.unit)], "moments") != Tier.NVME},
                "release_pool": True}

    def _fit_cache(self, room: int) -> int:
        if self.store is None or not self._planned_cache:
            return 0
        self.plan = cache_within(self.plan, self._planned_cache, room)
        self.store.cache = ParamCache([self._units[i] for i in sorted(self.plan.cached)])
        return sum(self.plan.units[i].shard for i in self.plan.cached)


def outside_state(groups: Sequence[dict]) -> int:
    """The process's resident memory now, less its parameters in host memory: what it holds
    outside the training state (Note [what the budget covers])."""
    params = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for g in groups for p in g["params"]
              if p.device.type == "cpu" and not p.is_meta}
    return max(0, resident_bytes() - sum(params.values())) + _FIRST_BACKWARD


_FIRST_BACKWARD = 16 << 20
"""Resident memory the first forward and backward add to the process whatever the model
(autograd's engine and its thread, kernels loaded on first use): 14 MiB measured here with
torch 2.13 on a 2-layer model, counted as memory outside the state."""

