"""The engine under one ZeroOptimizer: every object the assembly built, typed, in one place.

Lifecycle: built once, complete, at the end of the assembly (zeroshard/optim/assembly.py), from
objects each constructed with what it needs; until then what a construction attached is recorded
in ``construction.ConstructionRecord``, from which a construction refused part way is undone (Note
[refused construction] in construction.py). Once built,
the facade (zero_optimizer.py) delegates to it: the policy objects (``mesh``, ``sharding``,
``placement``, ``precision``) and the per-step objects (``grads``, ``stepper``). Code that
needs one of them takes that object, not the optimizer.
"""
from __future__ import annotations

from dataclasses import dataclass

from typing import TYPE_CHECKING, Any, Optional, Protocol

from torch import nn

from zeroshard.layout import Segment

from zeroshard.comm.codecs.link_codecs import LinkCodecs
from zeroshard.comm.mesh import MeshInfo
from zeroshard.comm.process_group import Comm
from zeroshard.comm.tensor_parallel import TensorParallel
from zeroshard.config import ZeroConfig
from zeroshard.offload.nvme_state import NvmeOptimizerState
from zeroshard.offload.activations.offloader import ActivationOffloader
from zeroshard.offload.placement import StatePlacement
from zeroshard.offload.unit_swap import NvmeUnitStore
from zeroshard.units.flat_unit import FlatUnit
from zeroshard.grads.links import GradLinks
from zeroshard.grads.reducer import GradientReducer
from zeroshard.grads.flow import GradientFlow
from zeroshard.optim.construction import ConstructionRecord
from zeroshard.optim.teardown import Teardown
from zeroshard.optim.module_guard import ModuleGuard
from zeroshard.units.run import Run
from zeroshard.units.step_in_flight import StepInFlight
from zeroshard.optim.stepper import Stepper
from zeroshard.precision.loss_scaler import DynamicLossScaler
from zeroshard.precision.precision_policy import Precision
from zeroshard.units.stage_policy import StagePolicy
from zeroshard.stages.sharding import Sharding
from zeroshard.stages.stage3.gatherer import ParameterGatherer

import torch

if TYPE_CHECKING:
    from zeroshard.resilience.memory_tier import MemoryTier



@dataclass(kw_only=True, eq=False)
class Engine:
    """Built once, complete, by the assembly (Note [assembly]); afterwards only the documented
    state below the objects changes (``closed``, ``ready``)."""
    config: ZeroConfig
    optimizer_class: type
    # the policy objects, one per axis
    mesh: MeshInfo
    sharding: Sharding
    placement: StatePlacement
    precision: Precision
    # the state they manage
    module: Optional[nn.Module]
    param_names: dict[int, str]
    units: list[FlatUnit]
    frozen_units: list[FlatUnit]
    runs: list[Run]
    inner: torch.optim.Optimizer
    swapper: Optional[NvmeOptimizerState]
    unit_store: Optional[NvmeUnitStore]
    # what moves gradients and steps
    inflight: StepInFlight
    reducer: GradientReducer
    grad_links: GradLinks
    grads: GradientFlow
    stepper: Stepper
    # what ties it to the model
    module_guard: Optional[ModuleGuard]
    teardown: Teardown
    record: ConstructionRecord
    """The construction's record: the hooks attached and the files opened, in order (``close_files``;
    the teardown removes the hooks)."""
    user_groups: list[dict]
    """The param groups torch code sees (the facade's ``param_groups``), as built."""
    user_defaults: dict
    """The defaults torch code sees: the user class's options (``kernel_choice.shown_options``)."""
    memory_tier: Optional[MemoryTier] = None
    """``redundancy="peer"``: the node-local memory tier (Note [peer memory tier])."""
    activations: Optional[ActivationOffloader] = None
    """Activation offload's hooks (``offload_activations=``; Note [activation offload])."""
    codecs: LinkCodecs
    """Quantized collectives: codecs per link, gradient residuals, per-step errors (Note
    [quantized collectives] in zeroshard/comm/codecs/coded.py)."""
    # state
    closed: bool = False
    ready: bool = False
    """Construction finished (torch's constructor adds the first param groups before)."""

    @property
    def save_instance(self) -> int:
        """The construction's number, the same on every rank: the key this engine's rank-only
        saves agree under (Note [rank-only state dicts])."""
        return self.record.instance

    # -- read through to the policy objects -------------------------------------------------------
    @property
    def policy(self) -> StagePolicy:
        return self.sharding.policy

    @property
    def shards_parameters(self) -> bool:
        """Stage 3: parameters persist only as owned slices (the one answer to "is this stage 3?";
        ``stage3_gatherer`` is the object that gathers them)."""
        return self.sharding.policy.shard_parameters

    @property
    def comm(self) -> Comm:
        return self.mesh.comm

    @property
    def replicas(self) -> Optional[Comm]:
        return self.mesh.replicas

    @property
    def tp(self) -> Optional[TensorParallel]:
        return self.mesh.tp

    @property
    def shard_group_ranks(self) -> Optional[tuple[tuple[int, ...], ...]]:
        return self.mesh.shard_group_ranks

    @property
    def gatherer(self) -> Optional[ParameterGatherer]:
        """Stage 3's gatherer, None otherwise: for reading only (tests, reports). Code that asks
        which stage this is reads ``shards_parameters``, and takes the gatherer from ``stage3_gatherer``."""
        return self.sharding.gatherer

    @property
    def stage3_gatherer(self) -> ParameterGatherer:
        """Stage 3's gatherer; a RuntimeError at stages 0-2 (ask ``shards_parameters`` first)."""
        return self.sharding.require_gatherer()

    @property
    def scaler(self) -> Optional[DynamicLossScaler]:
        return self.precision.scaler

    @property
    def all_units(self) -> list[FlatUnit]:
        """Trainable units, then frozen ones (stage 3: Note [frozen units])."""
        return self.units + self.frozen_units

    def joined(self) -> "Engine":
        """This engine once a step in flight has finished (Note [overlapped step]): code that
        reads ``units``, ``runs``, ``inner`` or ``swapper`` from outside the step asks through
        this, so it never sees a step half done."""
        self.inflight.join()
        return self

    def settled(self) -> "Engine":
        """``joined``, and a memory-tier commit in flight holds its copy of the state: code about
        to change the state (a step, a load) asks through this (Note [peer memory tier])."""
        self.inflight.join()
        if self.memory_tier is not None:
            self.memory_tier.copied()
        return self

    def quiet(self) -> "Engine":
        """``joined``, and a memory-tier commit in flight has finished (copied, stamped and
        replicated): before the engine lets go of its state (``close``)."""
        self.inflight.join()
        if self.memory_tier is not None:
            self.memory_tier.wait()
        return self

    def segment_index(self) -> dict[int, tuple[FlatUnit, Segment]]:
        """id(param) -> (unit, segment) for every managed parameter (frozen ones too), also under
        the sharded parameters torch code sees between uses (stage 3)."""
        visible = self.sharding.visible
        return {id(p): (u, seg) for u in self.joined().all_units for m, seg in zip(u.members, u.layout.segments)
                for p in {id(m.param): m.param, id(visible(m.param)): visible(m.param)}.values()}

    def weights_changed(self) -> None:
        """The model's parameters were written from outside: masters take the new values
        (the facade's ``model_weights_changed``)."""
        self.sharding.weights_changed(self.joined().units)

    def close_files(self) -> None:
        self.record.close_files()


class EngineOwner(Protocol):
    """What the modules under the facade may read of a ZeroOptimizer: its engine, and the param
    groups torch code sees (LR schedulers write them). The facade satisfies it; nothing below
    the facade names the facade (Note [the layers] in docs/design.md)."""

    engine: Engine
    param_groups: list[dict[str, Any]]
