"""The engine under one ZeroOptimizer: every object the assembly built, typed, in one place.

Lifecycle: created empty by the facade (``Engine(config, optimizer_class)``) and filled by the
assembly (zeroshard/optim/assembly.py) in build order, so a construction that fails part way
can be undone from what exists (Note [refused construction] in construction.py). Once built,
the facade (zero_optimizer.py) delegates to it: the policy objects (``mesh``, ``sharding``,
``placement``, ``precision``) and the per-step objects (``grads``, ``stepper``). Code that
needs one of them takes that object, not the optimizer.
"""
from __future__ import annotations

import itertools

from typing import Any, Callable, Optional, Protocol

from torch import nn

from zeroshard.layout import Segment

from zeroshard.comm.mesh import MeshInfo
from zeroshard.comm.process_group import Comm
from zeroshard.comm.tensor_parallel import TensorParallel
from zeroshard.config import ZeroConfig
from zeroshard.offload.nvme_state import NvmeOptimizerState
from zeroshard.offload.placement import StatePlacement
from zeroshard.offload.unit_swap import NvmeUnitStore
from zeroshard.units.flat_unit import FlatUnit
from zeroshard.grads.links import GradLinks
from zeroshard.grads.reducer import GradientReducer
from zeroshard.grads.flow import GradientFlow
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


_INSTANCES = itertools.count()


class Engine:
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
    reducer: GradientReducer
    grad_links: GradLinks
    grads: GradientFlow
    stepper: Stepper
    # what ties it to the model
    module_guard: Optional[ModuleGuard]
    teardown: Teardown
    user_groups: list[dict]
    """The param groups torch code sees (the facade's ``param_groups``), as built."""

    def __init__(self, config: ZeroConfig, optimizer_class: type) -> None:
        self.config = config
        self.optimizer_class = optimizer_class
        self.inflight = StepInFlight()
        self.files_closers: list[Callable[[], None]] = []
        """Closers of the swap files (run by ``close_files``: a rebuild, an undone construction)."""
        self.removers: list[Callable[[], None]] = []
        """What undoes each hook on the model, in the order attached."""
        self.closed = False
        self.ready = False
        """Construction finished (torch's constructor adds the first param groups before)."""
        self.save_instance = next(_INSTANCES)
        """A number for this engine, the same on every rank (each builds its optimizers in the same
        order): the key its rank-only saves agree under (Note [rank-only state dicts])."""
        """This engine's number in the store keys of its saves (Note [rank-only state dicts])."""
        self.collectives_done = False
        """The construction's own collectives are behind (Note [agreed construction])."""

    # -- read through to the policy objects -------------------------------------------------------
    @property
    def policy(self) -> StagePolicy:
        return self.sharding.policy

    @property
    def shards_parameters(self) -> bool:
        """Stage 3: parameters persist only as owned slices (the one answer to "is this stage 3?";
        ``gatherer`` is the object that gathers them, None otherwise)."""
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
        return self.sharding.gatherer if "sharding" in self.__dict__ else None

    @property
    def scaler(self) -> Optional[DynamicLossScaler]:
        return self.precision.scaler

    @property
    def all_units(self) -> list[FlatUnit]:
        """Trainable units, then frozen ones (stage 3: Note [frozen units])."""
        return self.units + self.__dict__.get("frozen_units", [])

    def joined(self) -> "Engine":
        """This engine once a step in flight has finished (Note [overlapped step]): code that
        reads ``units``, ``runs``, ``inner`` or ``swapper`` from outside the step asks through
        this, so it never sees a step half done."""
        self.inflight.join()
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
        for closer in self.files_closers:
            closer()


class EngineOwner(Protocol):
    """What the modules under the facade may read of a ZeroOptimizer: its engine, and the param
    groups torch code sees (LR schedulers write them). The facade satisfies it; nothing below
    the facade names the facade (Note [the layers] in docs/design.md)."""

    engine: Engine
    param_groups: list[dict[str, Any]]
