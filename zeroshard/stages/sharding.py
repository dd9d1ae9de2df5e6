"""The sharding policy of one ZeroOptimizer: what each stage keeps whole and what it splits, and
(stage 3) the machinery that gathers parameters on demand.

Lifecycle: built once by the assembly (zeroshard/optim/assembly.py) from the stage's
``StagePolicy`` and the mesh. Before any unit exists it says which parameters the units hold
(``frozen``: stage 3 partitions frozen weights too, Note [frozen units]) and how they are laid
out (``lay_out``: buckets of a size at stages 0-2, one unit per module at stage 3); once the
units are built, ``start`` puts the gatherer in place (stage 3, with hpZ's secondary
partition); after each step ``gather_params`` makes the full parameters current; ``close``
gives stage-3 parameters their full values back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch
from torch import nn

from zeroshard.comm.codecs.link_codecs import LinkCodecs
from zeroshard.comm.mesh import HpzMesh, MeshInfo
from zeroshard.layout import NamedParam, UnitLayout, build_layouts, layouts_for
from zeroshard.layout.bucketing import layouts_with_owners, owner_layouts
from zeroshard.units.stage_policy import StagePolicy
from zeroshard.stages.stage3.frozen import frozen_params, split_frozen
from zeroshard.stages.stage3.gatherer import ParameterGatherer
from zeroshard.stages.stage3.secondary import SecondaryPartition
from zeroshard.stages.stage3.units import plan_units

if TYPE_CHECKING:
    from zeroshard.config import ZeroConfig
    from zeroshard.units.flat_unit import FlatUnit

Layouts = list[tuple[UnitLayout, list[NamedParam]]]


@dataclass
class UnitPlan:
    """The layouts of the trainable units and (stage 3) of the frozen ones, with the module
    each unit belongs to (None: the root unit)."""
    layouts: Layouts
    modules: list[Optional[nn.Module]]
    frozen_layouts: Layouts
    frozen_modules: list[Optional[nn.Module]]


class Sharding:
    def __init__(self, policy: StagePolicy, mesh: MeshInfo, config: ZeroConfig,
                 codecs: Optional[LinkCodecs] = None) -> None:
        self.policy = policy
        self.mesh = mesh
        self.config = config
        self.codecs = codecs
        """Quantized parameter gathers (Note [quantized collectives] in zeroshard/comm/codecs/coded.py)."""
        self.gatherer: Optional[ParameterGatherer] = None
        """Stage 3's on-demand gathers (zeroshard/stages/stage3/gatherer.py), from ``start``. Whether
        there is one is not the stage's answer (``shard_parameters`` is): read it through
        ``require_gatherer``."""

    @property
    def shard_parameters(self) -> bool:
        return self.policy.shard_parameters

    def require_gatherer(self) -> ParameterGatherer:
        """Stage 3's gatherer; a RuntimeError at stages 0-2 (ask ``shard_parameters`` first) or
        before ``start`` built it."""
        gatherer = self.gatherer
        if not isinstance(gatherer, ParameterGatherer):  # (the one place its absence is looked at)
            if not self.policy.shard_parameters:
                raise RuntimeError(f"stage={self.config.stage} keeps parameters whole: there is no stage-3 "
                                   "ParameterGatherer (ask shard_parameters / Engine.shards_parameters first)")
            raise RuntimeError(f"stage={self.config.stage}: the ParameterGatherer is built once every unit is "
                               "(Sharding.start), which has not run yet")
        return gatherer

    def frozen(self, module: Optional[nn.Module], meta_shapes: dict[int, torch.Size],
               trained: frozenset[int]) -> list[NamedParam]:
        """The weights the units hold untrained (those not in ``trained``): stage 3's (Note
        [frozen units] in stages/stage3/frozen.py); none at stages 0-2, where they stay as they are."""
        if not self.policy.shard_parameters or module is None:
            return []
        return frozen_params(module, meta_shapes, trained)

    def lay_out(self, module: Optional[nn.Module], trainable: list[NamedParam], frozen: list[NamedParam],
                bucket_numel: int, dtype_of: Callable[[NamedParam], torch.dtype],
                whole_groups: frozenset[int] = frozenset()) -> UnitPlan:
        """Units over ``trainable`` (and ``frozen``): at stage 3 one per module of the unit plan
        (``dtype_of``: a frozen weight's dtype once cast), at stages 0-2 buckets of ``bucket_numel``.
        Parameters of ``whole_groups`` (an optimizer that reads whole tensors) are kept whole,
        each in one owner rank's slice (Note [whole-tensor units] in layout/bucketing.py)."""
        world = self.mesh.comm.world_size
        if not self.policy.shard_parameters or module is None:
            flat = build_layouts([m for m in trainable if m.group not in whole_groups], bucket_numel, world)
            whole = owner_layouts([m for m in trainable if m.group in whole_groups], world, bucket_numel, len(flat))
            return UnitPlan(flat + whole, [], [], [])
        groupings, modules, frozen_groupings, frozen_modules = split_frozen(
            *plan_units(module, trainable + frozen, self.config.stage3_unit_classes, self.config.stage3_unit_numel),
            trained=frozenset(id(m.param) for m in trainable), dtype_of=dtype_of)
        layouts = layouts_with_owners(groupings, world, whole_groups)
        return UnitPlan(layouts, modules, layouts_for(frozen_groupings, world, len(layouts)) if frozen else [],
                        frozen_modules if frozen else [])

    def start(self, units: Sequence[FlatUnit], plan: UnitPlan, module: Optional[nn.Module],
              live_units: Optional[int] = None) -> None:
        """Stage 3, every unit built: from here on torch code sees sharded parameters.
        ``live_units``: the placement's choice (``StatePlacement.live_units``)."""
        if not self.policy.shard_parameters or module is None:
            return
        self.gatherer = ParameterGatherer(units, plan.modules + plan.frozen_modules, module, self.mesh.comm,
                                          live_units or self.config.max_live_units or 2, codecs=self.codecs)
        if isinstance(self.mesh, HpzMesh):
            self.gatherer.secondary = SecondaryPartition(units, self.mesh.comm, self.codecs)

    def visible(self, p: torch.Tensor) -> torch.Tensor:
        """The parameter torch code holds for ``p`` (stage 3: the sharded one between uses)."""
        return self.require_gatherer().visible(p) if self.policy.shard_parameters else p

    def gather_params(self, units: Sequence[FlatUnit]) -> None:
        """Makes every rank's full parameters current from the owned ranges (after a step or
        after loading owned pieces). A collective."""
        if self.policy.gather_after_step:
            works = [self.mesh.comm.gather_shards(u.flat) for u in units]
            for w in works:
                w.wait()
        elif self.policy.shard_parameters:
            sec = self.require_gatherer().secondary  # hpZ: across nodes once per step (Note [hpZ secondary partition])
            if sec is not None:
                sec.rebuild([i for i in range(len(sec.units)) if i < len(units) or sec.stale[i]])  # (frozen: if written)

    def weights_changed(self, units: Sequence[FlatUnit]) -> None:
        """The model's parameters were written from outside: the fp32 masters of stages 0-2 take
        the new values. (Stage-3 parameters write through their unit: Note [sharded tensor ops].)"""
        if self.policy.shard_parameters:
            return
        with torch.no_grad():
            for unit in units:
                if unit.separate_master:
                    lo, hi = unit.owned
                    unit.load_segment(lo, unit.flat[lo:hi].float())
