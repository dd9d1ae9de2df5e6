"""Where each unit's state lives, for one ZeroOptimizer: the explicit options' single choice, or
the per-unit plan of ``offload="auto"`` (Note [automatic placement] in
zeroshard/planner/auto_placement.py), and what it took to apply it.

Lifecycle: built from the layouts before any unit exists (``StatePlacement(config, policy, ...)``);
while the units are built it gives each its ``Placement`` (``of_unit``) and hands it to the
swap file with the parts the plan puts there (``adopt``); the optimizer state then learns
which runs keep their moments in memory (``resident_moments``); afterwards it reports
(``report``) what was decided, why, and the bytes the swap files moved.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from zeroshard.units.elementwise import update_kind

from zeroshard.io.host_pool import HOST_POOL
from zeroshard.offload.param_cache import ParamCache
from zeroshard.offload.peak_memory import (StepPeaks, cache_within, resident_bytes, return_freed_memory,
                                           trim_freed_memory)
from zeroshard.offload.swap_file import aligned
from zeroshard.offload.unit_swap import NvmeUnitStore
from zeroshard.config import Placement, ZeroConfig
from zeroshard.planner.auto_placement import (KINDS, Fixed, MemoryBudget, Plan, Tier, UnitSpec, plan_auto,
                                              plan_explicit, report_text)

if TYPE_CHECKING:  # (types only: the optimizer state and runs are built after the placement)
    from torch import nn

    from zeroshard.layout import NamedParam, UnitLayout
    from zeroshard.offload.nvme_state import NvmeOptimizerState
    from zeroshard.units.flat_unit import FlatUnit
    from zeroshard.units.run import Run
    from zeroshard.units.stage_policy import StagePolicy


FrozenUnit = tuple["UnitLayout", Sequence["NamedParam"], torch.dtype, Optional["nn.Module"]]
"""A stage-3 frozen unit before it is built: layout, members, dtype, module (None: the root)."""


def describe_units(config: ZeroConfig, policy: StagePolicy, rank: int, layouts: Sequence[tuple[Any, Any]],
                   unit_modules: Sequence[Any], param_dtype: torch.dtype, groups: Sequence[dict],
                   accelerator: bool, frozen_units: Sequence[FrozenUnit] = ()) -> tuple[list[UnitSpec], Fixed]:
    """Each unit's bytes per kind of state on ``rank``, and the memory placement cannot move
    (Note [automatic placement]). ``frozen_units``: stage 3's frozen units (layout, members,
    dtype, module), described after the trainable ones (a shard each: Note [frozen units])."""
    p = torch.finfo(param_dtype).bits // 8 if param_dtype.is_floating_point else 4
    s = 8 if param_dtype == torch.float64 else 4
    mixed = param_dtype not in (torch.float32, torch.float64)
    specs, largest_run = [], 0
    gathered: dict[int, int] = {}  # id(module) -> bytes of its units gathered (one group: Note [frozen units])
    for i, (layout, _) in enumerate(layouts):
        lo, hi = layout.slice_of(rank) if policy.shard_optimizer else (0, layout.padded_numel)
        n = hi - lo
        root = policy.shard_parameters and i < len(unit_modules) and unit_modules[i] is None
        separate = mixed or accelerator  # (a master on the host beside a shard on the device)
        runs = [2 * aligned(4 * (b - a)) for _, a, b in layout.group_runs(lo, hi)]
        largest_run = max([largest_run] + runs)
        specs.append(UnitSpec(i, shard=p * n if policy.shard_parameters else 0, master=s * n if separate else 0,
                              grad=s * (n if policy.shard_gradients else layout.padded_numel), moments=sum(runs),
                              shard_reads=1 if root else 2,
                              master_in_shard=policy.shard_parameters and not separate, root=root))
        module = unit_modules[i] if i < len(unit_modules) else None
        gathered[id(module)] = gathered.get(id(module), 0) + p * layout.padded_numel
    laid_out = set()
    for layout, members, dtype, module in frozen_units:
        root = module is None
        b = torch.empty((), dtype=dtype).element_size()
        lo, hi = layout.slice_of(rank)
        specs.append(UnitSpec(len(specs), shard=b * (hi - lo), master=0, grad=0, moments=0,
                              shard_reads=1 if root else 2, root=root, frozen=True))
        gathered[id(module)] = gathered.get(id(module), 0) + b * layout.padded_numel
        laid_out |= {id(m.param) for m in members}
    widest_root = gathered.get(id(None), 0)
    widest = max((v for k, v in gathered.items() if k != id(None)), default=0)
    frozen = sum(q.numel() * q.element_size() for g in groups for q in g["params"]
                 if not q.requires_grad and id(q) not in laid_out)
    if policy.shard_parameters:  # the gather buffers of the groups alive at once
        model = widest_root + live_units(config) * widest
    else:  # the model's own copy, which placement cannot move
        model = sum(p * layout.padded_numel for layout, _ in layouts)
    widest_numel = max((layout.padded_numel for layout, _ in layouts), default=0)
    buckets = config.max_inflight_buckets * 4 * widest_numel
    working = 2 * p * widest_numel  # (Note [what the budget covers])
    parts = largest_parts(specs)
    slots = 3 if config.offload_buffer_mb is None else max(1, min(3, int(config.offload_buffer_mb * 2**20
                                                                       // max(1, largest_run + parts))))
    # Released CPU buffers the host pool keeps for the next of their size (Note [reused host
    # buffers] in zeroshard/io/host_pool.py): up to max_buffers of the largest it was given,
    # a unit's gathered buffer or gradient bucket; in memory beside the live ones (measured:
    # a 64-block LoRA step peaked 110 MiB over a plan without them).
    flats = [p * layout.padded_numel for layout, _ in layouts] + [
        torch.empty((), dtype=d).element_size() * layout.padded_numel for layout, _, d, _ in frozen_units]
    largest_flat = max(flats, default=0) if policy.shard_parameters else 0
    retained = 0 if accelerator or not HOST_POOL.enabled else HOST_POOL.max_buffers * max(largest_flat,
                                                                                          4 * widest_numel)
    return specs, Fixed(device=model + frozen + buckets + working + retained, staging=slots * parts,
                        pool=slots * largest_run, working=working, group=widest if policy.shard_parameters else 0)


def live_units(config: ZeroConfig, chosen: Optional[int] = None) -> int:
    """Stage 3's groups gathered or being read at once: ``max_live_units``, else what
    ``offload="auto"`` chose (``chosen``), else 2 (Note [prefetch depth] in
    zeroshard/stages/stage3/gatherer.py)."""
    return config.max_live_units or chosen or 2


def largest_parts(specs: Sequence[UnitSpec]) -> int:
    """Bytes of the largest unit's shard, master and gradient: what one unit in flight holds
    (a frozen unit's shard is read straight into its gather buffer, counted apart)."""
    return max((u.shard + u.master + u.grad for u in specs if not u.frozen), default=0)


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


class StatePlacement:
    def __init__(self, config: ZeroConfig, policy: StagePolicy, rank: int, optimizer_class: type,
                 layouts: Sequence[tuple[Any, Any]], unit_modules: Sequence[Any], param_dtype: torch.dtype,
                 groups: Sequence[dict], device: Optional[torch.device],
                 frozen_units: Sequence[FrozenUnit] = ()) -> None:
        self.config = config
        first = next((m.param for _, members in layouts for m in members), None)
        model_device = device or (first.device if first is not None else torch.device("cpu"))
        self.accelerator = model_device.type != "cpu"
        self.auto = config.offload == "auto"
        # (offload="auto" places the frozen units too, after the trainable ones: a LoRA base past
        # memory streams like any shard; explicit options give them offload_params)
        specs, fixed = describe_units(config, policy, rank, layouts, unit_modules, param_dtype, groups,
                                      self.accelerator, frozen_units if self.auto else ())
        self.specs = specs
        self.live_units = live_units(config)
        """Stage 3's groups gathered at once (Note [prefetch depth]): 3 where offload="auto"
        found room for one more (``max_live_units`` unset), else ``max_live_units`` or 2."""
        if self.auto:
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
            self.plan: Plan = plan_auto(specs, budget, fixed, accelerator=self.accelerator,
                                        nvme=config.nvme_path is not None, deeper=group)
            self.live_units = live_units(config, 3 if self.plan.deeper else None)
            # (whole-tensor classes stream state of their own: Note [generic state on NVMe])
            streamable = [c for c in {g.get("optimizer_class", optimizer_class) for g in groups}
                          if not (isinstance(c, type) and issubclass(c, (torch.optim.Adam, torch.optim.AdamW)))
                          and update_kind(c) != "whole"]
            cls = streamable[0] if streamable else optimizer_class
            if self.plan.offloads and streamable:
                raise ValueError(
                    f"offload='auto' must offload part of the state to fit memory_budget ({budget}), and offloaded "
                    f"state is stepped by the fused Adam/AdamW kernel, which {getattr(cls, '__name__', cls)} does not "
                    f"run on; use torch.optim.Adam/AdamW, or a budget that holds everything (at least "
                    f"{fixed.device + fixed.host + sum(u.size(k) for u in specs for k in KINDS)} bytes here)")
        else:
            self.plan = plan_explicit(specs, fixed, accelerator=self.accelerator,
                                      optimizer=config.offload_optimizer, params=config.offload_params)
        self._index: dict[int, int] = {}
        self._units: list["FlatUnit"] = []
        self.peaks: Optional[StepPeaks] = None
        self._planned_cache = self.plan.cached
        if self.auto:
            self.peaks = StepPeaks(host_budget, calibrate=budget.reserve is None, fit_cache=self._fit_cache,
                                   margin=host_budget // 50 + largest_parts(specs))
            if self.peaks.calibrate and self.peaks.works and self.plan.cached:  # sized after step 1
                self.plan = cache_within(self.plan, self._planned_cache, 0,
                                         "parameter cache: empty until step 1, whose measured peak sizes it")
        self.store: Optional[NvmeUnitStore] = None
        self._explicit_nvme = not self.auto and config.offload_optimizer == "nvme"
        if self._explicit_nvme or (self.auto and any(self.plan.swapped(i) for i in range(len(specs)))):
            swap_shards = (config.offload_params == "nvme" if not self.auto else
                           any("shard" in self.plan.swapped(i) for i in range(len(specs))))
            if config.nvme_path is None:  # (ZeroConfig requires it for "nvme"; the planner swaps only with it)
                raise RuntimeError("state placed on NVMe without nvme_path: pass nvme_path= a directory")
            self.store = NvmeUnitStore(config.nvme_path, rank, swap_shards=swap_shards)  # (its owner closes it)
            if self.plan.cached:
                self.store.cache = _PendingCache(self.plan.cached)

    # -- while the units are built ------------------------------------------------------------
    @property
    def streams_optimizer(self) -> bool:
        """The host-side step of ``NvmeOptimizerState`` runs (explicit NVMe offload, or a plan
        that offloads anything)."""
        return self._explicit_nvme or (self.auto and self.plan.offloads)

    def of_unit(self, index: int) -> Placement:
        if not self.auto:
            return self.config.placement
        if not self.plan.offloads:
            return Placement()
        shard = {"device": None, "host": "cpu", "nvme": "nvme"}[self.plan.tier(index, "shard")]
        return Placement(optimizer="nvme", params=shard if self.specs[index].shard else None)

    def of_frozen(self, index: int) -> Placement:
        """A frozen unit's placement (``index`` counts frozen units from 0): ``offload_params``
        under the explicit options, the plan's tier for its shard under offload="auto"."""
        if not self.auto:
            return self.config.placement
        i = self._frozen_index(index)
        if i is None or not self.plan.offloads:
            return Placement()
        return Placement(params={"device": None, "host": "cpu", "nvme": "nvme"}[self.plan.tier(i, "shard")])

    def _frozen_index(self, index: int) -> Optional[int]:
        i = sum(1 for u in self.specs if not u.frozen) + index
        return i if i < len(self.specs) and self.specs[i].frozen else None

    def adopt_frozen(self, unit: FlatUnit) -> None:
        """Hands a frozen unit's shard to the swap file where it streams (the explicit options:
        ``offload_params="nvme"``; auto: the plan's tier)."""
        if not self.auto:
            if self.store is not None and self.config.params_swapped:
                self.store.adopt(unit)
            return
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

    def adopt(self, unit: "FlatUnit") -> None:
        index = len(self._index)
        self._index[id(unit)] = index
        self._units.append(unit)
        if self.store is None:
            return
        if not self.auto:
            self.store.adopt(unit)
        elif self.plan.swapped(index):
            self.store.adopt(unit, [p for p in self.plan.swapped(index) if p != "master" or unit.separate_master])
        if isinstance(self.store.cache, _PendingCache) and index in self.store.cache.indices:
            self.store.cache.units.append(unit)

    def finish(self) -> None:
        """Every unit is built: the parameter cache knows its units."""
        if self.store is not None and isinstance(self.store.cache, _PendingCache):
            self.store.cache = ParamCache(self.store.cache.units)

    def state_options(self, runs: Sequence["Run"], slots: int) -> dict:
        """``NvmeOptimizerState``'s placement options: the runs whose moments stay in memory, and
        whether its pool lives only during the step (auto: the parameter cache uses it in
        between). The swap file of the units gets the ``slots`` the staging memory allows."""
        self.finish()
        if self.store is not None:
            self.store.max_in_flight = slots
        if not self.auto:
            return {}
        tier = self.plan.tier
        return {"resident": {id(r.tensor) for r in runs if tier(self._index[id(r.unit)], "moments") != "nvme"},
                "release_pool": True}

    # -- afterwards -----------------------------------------------------------------------------
    def watch(self, reducer: Any) -> None:
        """Measures each step's peak memory from its first backward (StepPeaks)."""
        if self.peaks is not None:
            reducer.on_pass_start.append(self.peaks.on_backward)
            reducer.on_pass_end.append(self.peaks.on_backward_end)
            reducer.on_pass_end.append(trim_freed_memory)  # (after the peak is read)

    def release_held(self) -> None:
        """Writes and releases the parts torch code touched before the step (Note [parts held
        for torch code] in zeroshard/offload/unit_swap.py)."""
        if self.store is not None:
            self.store.release_held()

    def after_step(self) -> None:
        if self.peaks is not None:
            self.peaks.after_step()
            trim_freed_memory()

    def _fit_cache(self, room: int) -> int:
        if self.store is None or not self._planned_cache:
            return 0
        self.plan = cache_within(self.plan, self._planned_cache, room)
        self.store.cache = ParamCache([self._units[i] for i in sorted(self.plan.cached)])
        return sum(self.plan.units[i].shard for i in self.plan.cached)

    def applied(self, runs: Sequence[Run], swapper: Optional[NvmeOptimizerState]) -> dict[str, dict[str, int]]:
        """Bytes per kind in memory and in the swap files as the units and the optimizer state
        (``runs``, streamed by ``swapper``) hold them (what the plan's ``bytes_by`` predicts;
        memory is reported as "memory")."""
        out = {k: {"memory": 0, "nvme": 0} for k in KINDS}
        for u in self._units:
            if u.frozen:
                out["shard"]["nvme" if u.swapped("shard") else "memory"] += u.shard.numel() * u.shard.element_size()
                continue
            parts = (("shard", u.shard) if u.policy.shard_parameters else None,
                     ("master", u.master) if u.separate_master else None, ("grad", u.grad_store))
            for kind, t in filter(None, parts):
                out[kind]["nvme" if u.swapped(kind) else "memory"] += t.numel() * t.element_size()
        for r in runs:
            nbytes = 2 * aligned(4 * r.tensor.numel())
            kept = swapper is None or swapper.in_memory(r.tensor)
            nbytes = swapper.state_bytes(r.tensor) if swapper is not None else nbytes
            out["moments"]["memory" if kept else "nvme"] += nbytes
        return out

    def measured_io(self, swapper: Optional[NvmeOptimizerState]) -> dict[str, float]:
        """Bytes the swap files have read and written since construction, and of those the
        bytes that went through O_DIRECT (``direct``, Note [aligned swap parts]); of the reads,
        the stage-3 shards read for gathers (``gather_read``; ``frozen_gather_read``: frozen
        units', a LoRA base's) and the seconds forward and backward waited on them
        (``gather_wait_s``: the I/O wait the prefetch did not hide)."""
        files = [f for f in (swapper.file if swapper is not None else None,
                             self.store.file if self.store is not None else None) if f is not None]
        store = self.store
        return {"read": sum(f.bytes_read for f in files), "written": sum(f.bytes_written for f in files),
                "direct": sum(f.direct_bytes for f in files),
                "gather_read": store.gather_read if store is not None else 0,
                "frozen_gather_read": store.frozen_gather_read if store is not None else 0,
                "gather_wait_s": store.gather_wait_s if store is not None else 0.0}

    def report(self, runs: Sequence[Run], swapper: Optional[NvmeOptimizerState], micro_batches: int = 1) -> dict:
        """What was decided and why: bytes per kind and tier (planned, and as the units hold them
        now), per unit, the parameter cache, the predicted traffic per step of ``micro_batches``
        backward passes and the predicted peak memory, and what the swap files moved so far."""
        plan = self.plan
        measured = self.measured_io(swapper)
        return {
            "mode": plan.mode,
            "budget": None if plan.budget is None else {"device": plan.budget.device, "host": plan.budget.host},
            "accelerator": plan.accelerator,
            "bytes": plan.bytes_by(),
            "units": [{"index": u.index, **{k: plan.tier(u.index, k) for k in KINDS if u.size(k)},
                       "cached": u.index in plan.cached} for u in plan.units],
            "cache": {"units": sorted(plan.cached), "bytes": sum(plan.units[i].shard for i in plan.cached)},
            "applied": self.applied(runs, swapper),
            "predicted_step_io": plan.step_io(micro_batches),
            "predicted_memory": plan.memory(),
            "measured_io": measured,
            "peak_memory": self.peaks.report() if self.peaks is not None else None,
            "reasons": list(plan.reasons),
            "text": report_text(plan, measured),
        }


class _PendingCache:
    """The cached units' indices until the units exist (never keeps a shard meanwhile)."""

    def __init__(self, indices: frozenset[int]) -> None:
        self.indices = indices
        self.units: list["FlatUnit"] = []

    def keep(self, unit: "FlatUnit", backward: bool) -> bool:
        return False
