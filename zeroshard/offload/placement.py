"""Where each unit's state lives, for one ZeroOptimizer: what the two placements share
(``StatePlacement``), and the sizes they place (``describe_units``). ``ExplicitPlacement``
(offload/placement_explicit.py) gives every unit the explicit options' single choice,
``AutoPlacement`` (offload/placement_auto.py) the per-unit plan of ``offload="auto"`` (Note
[automatic placement] in zeroshard/planner/auto_placement.py); ``placement_class``
(offload/placement_choice.py) picks one from the config, once.

Lifecycle: built from the layouts before any unit exists (``StatePlacement(config, policy, ...)``);
while the units are built it gives each its ``Placement`` (``of_unit``) and hands it to the
swap file with the parts the plan puts there (``adopt``); the optimizer state then learns
which runs keep their moments in memory (``state_options``); afterwards it reports
(``report``) what was decided, why, and the bytes the swap files moved.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch

from zeroshard.io.host_pool import HOST_POOL
from zeroshard.offload.param_cache import ParamCache
from zeroshard.offload.peak_memory import StepPeaks, trim_freed_memory
from zeroshard.offload.swap_file import aligned
from zeroshard.offload.unit_swap import NvmeUnitStore
from zeroshard.config import Placement, ZeroConfig
from zeroshard.planner.activation_plan import ActivationPlan
from zeroshard.planner.auto_placement import KINDS, Fixed, Plan, UnitSpec, report_text

JointActivations = Callable[[Plan, bool], Optional[ActivationPlan]]
"""The best activation plan in what a state plan leaves of the budget: None where none fits, or
(explain=True) a ValueError naming what fits (Note [joint state and activation plan])."""

if TYPE_CHECKING:  # (types only: the optimizer state and runs are built after the placement)
    from torch import nn

    from zeroshard.layout import NamedParam, UnitLayout
    from zeroshard.offload.nvme_state import NvmeOptimizerState
    from zeroshard.units.flat_unit import FlatUnit
    from zeroshard.units.run import Run
    from zeroshard.units.stage_policy import StagePolicy


FrozenUnit = tuple["UnitLayout", Sequence["NamedParam"], torch.dtype, Optional["nn.Module"]]
"""A stage-3 frozen unit before it is built: layout, members, dtype, module (None: the root)."""

UnitLayouts = Sequence[tuple["UnitLayout", Sequence["NamedParam"]]]
"""The trainable units' layouts with their members, in unit order."""


def describe_units(config: ZeroConfig, policy: StagePolicy, rank: int, layouts: UnitLayouts,
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


class StatePlacement:
    """What both placements share: the units' sizes (``specs``), the plan (``plan``), the swap
    file of the units (``store``) and what it moved, the step's peak memory (``peaks``, under a
    budget) and the report. A subclass decides: its plan (``_decide``), each unit's
    ``Placement`` (``of_unit``, ``of_frozen``), the parts it hands to the swap file (``adopt``,
    ``adopt_frozen``) and the optimizer state's options. A ``placement_policy`` given by a
    user subclasses this class (or one of the two) and overrides what it decides; it is built
    over the placement the config names (``placement_class``)."""

    def __init__(self, config: ZeroConfig, policy: StagePolicy, rank: int, optimizer_class: type,
                 layouts: UnitLayouts, unit_modules: Sequence[Any], param_dtype: torch.dtype,
                 groups: Sequence[dict], device: Optional[torch.device],
                 frozen_units: Sequence[FrozenUnit] = (), activations: Optional[JointActivations] = None) -> None:
        self.config = config
        self.joint_activations = activations
        """offload="auto" with a declared micro-batch: the best activation plan in what a state plan
        leaves, to plan both together (Note [joint state and activation plan]); None: state first."""
        self.joint: Optional[dict] = None
        """The joint choice's report (``JointChoice.report``), when one was made."""
        self.re_place_blocker: Optional[str] = "only offload='auto' places the state with the activations"
        """Why the state will not be placed again at the first forward (Note [state re-placed at the
        first forward] in zeroshard/offload/placement_replan.py); None: it may be."""
        self.shards_parameters = policy.shard_parameters
        """Stage 3: a re-placement at the first forward moves shards too, which the gatherer reads."""
        self.swapper: Optional["NvmeOptimizerState"] = None
        """The moments' stream, once built (what a re-placement lays out again)."""
        self._runs: list["Run"] = []
        first = next((m.param for _, members in layouts for m in members), None)
        model_device = device or (first.device if first is not None else torch.device("cpu"))
        self.accelerator = model_device.type != "cpu"
        specs, fixed = describe_units(config, policy, rank, layouts, unit_modules, param_dtype, groups,
                                      self.accelerator, self._placed_frozen(frozen_units))
        self.specs = specs
        self.live_units = live_units(config)
        """Stage 3's groups gathered at once (Note [prefetch depth]): 3 where offload="auto"
        found room for one more (``max_live_units`` unset), else ``max_live_units`` or 2."""
        self._index: dict[int, int] = {}
        self._units: list["FlatUnit"] = []
        self.peaks: Optional[StepPeaks] = None
        self.plan: Plan = self._decide(fixed, optimizer_class, layouts, param_dtype, groups)
        self.store: Optional[NvmeUnitStore] = None
        if self._swap_file_needed():
            if config.nvme_path is None:  # (ZeroConfig requires it for "nvme"; the planner swaps only with it)
                raise RuntimeError("state placed on NVMe without nvme_path: pass nvme_path= a directory")
            self.store = NvmeUnitStore(config.nvme_path, rank,  # (its owner closes it)
                                       swap_shards=self._shards_swapped())
            if self.plan.cached:
                self.store.cache = _PendingCache(self.plan.cached)

    # -- what a placement decides ---------------------------------------------------------------
    def _placed_frozen(self, frozen_units: Sequence[FrozenUnit]) -> Sequence[FrozenUnit]:
        """The frozen units this placement places itself (described after the trainable ones)."""
        raise self._undecided()

    def _decide(self, fixed: Fixed, optimizer_class: type, layouts: UnitLayouts,
                param_dtype: torch.dtype, groups: Sequence[dict]) -> Plan:
        """The plan over ``self.specs`` (run once, in the constructor)."""
        raise self._undecided()

    def _swap_file_needed(self) -> bool:
        """Some unit's parts live in the units' swap file."""
        raise self._undecided()

    def _shards_swapped(self) -> bool:
        """Some unit's stage-3 shard lives in the units' swap file."""
        raise self._undecided()

    @property
    def streams_optimizer(self) -> bool:
        """The host-side step of ``NvmeOptimizerState`` runs."""
        raise self._undecided()

    @property
    def optimizer_on_host(self) -> bool:
        """Every unit's master and moments live in host memory, stepped there one unit at a
        time (``offload_optimizer="cpu"``: the stepper's choice)."""
        raise self._undecided()

    def of_unit(self, index: int) -> Placement:
        """The trainable unit ``index``'s placement."""
        raise self._undecided()

    def of_frozen(self, index: int) -> Placement:
        """A frozen unit's placement (``index`` counts frozen units from 0)."""
        raise self._undecided()

    def adopt_frozen(self, unit: FlatUnit) -> None:
        """Hands a frozen unit's shard to the swap file where it streams."""
        raise self._undecided()

    def _hand_over(self, store: NvmeUnitStore, unit: FlatUnit, index: int) -> None:
        """Hands the trainable unit ``index`` to the units' swap file with the parts it streams."""
        raise self._undecided()

    def _state_options(self, runs: Sequence[Run]) -> dict:
        """``NvmeOptimizerState``'s placement options (see ``state_options``)."""
        raise self._undecided()

    def _undecided(self) -> NotImplementedError:
        return NotImplementedError(
            f"{type(self).__name__} decides nothing of its own here: subclass ExplicitPlacement or AutoPlacement, "
            "or give it as placement_policy= (built over the placement the config names: placement_class)")

    # -- while the units are built ------------------------------------------------------------
    def adopt(self, unit: "FlatUnit") -> None:
        index = len(self._index)
        self._index[id(unit)] = index
        self._units.append(unit)
        if self.store is None:
            return
        self._hand_over(self.store, unit, index)
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
        return self._state_options(runs)

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
            **({"joint": self.joint} if self.joint is not None else {}),
            "text": report_text(plan, measured),
        }


class _PendingCache:
    """The cached units' indices until the units exist (never keeps a shard meanwhile)."""

    def __init__(self, indices: frozenset[int]) -> None:
        self.indices = indices
        self.units: list["FlatUnit"] = []

    def keep(self, unit: "FlatUnit", backward: bool) -> bool:
        return False
