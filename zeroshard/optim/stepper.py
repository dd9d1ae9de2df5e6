"""The update of one ZeroOptimizer step: which path runs it, for the placement and precision chosen.

Lifecycle: built once by the assembly (zeroshard/optim/assembly.py). ``clip`` notes a
clipping coefficient (applied inside the fused pass where one runs); ``step`` copies the
user's hyperparameters in, finds what got no gradient anywhere, and runs the update on the
path the state's placement calls for:

- swapped state and stage 3 with overlap: in the background (Note [overlapped step]);
- swapped state: ``NvmeOptimizerState`` streams moments through the fused kernel;
- state on the host with the fused kernel: unit by unit, each unit's new weights going back to
  the device while the next is updated;
- otherwise the inner optimizer in one pass (the fused one writes the bf16/fp16 copy too).

Then every rank's parameters are made current (``Sharding.gather_params``).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from zeroshard.comm.mesh import MeshInfo
from zeroshard.config import ZeroConfig
from zeroshard.offload.nvme_state import NvmeOptimizerState
from zeroshard.offload.placement import StatePlacement
from zeroshard.ops import FusedAdam
from zeroshard.grads import clipping, norm as grad_norm, untouched
from zeroshard.optim import kernel_choice
from zeroshard.units import step_in_flight
from zeroshard.units.flat_unit import FlatUnit
from zeroshard.grads.flow import GradientFlow
from zeroshard.units.run import Run
from zeroshard.units.step_in_flight import StepInFlight
from zeroshard.precision.precision_policy import Precision
from zeroshard.stages.sharding import Sharding
from zeroshard.testing import kill_points


def copy_out_ok(unit: FlatUnit) -> bool:
    """The fused pass can write the updated master straight into the low-precision shard (the
    kernel's copy-out): both sit on the CPU. Elsewhere ``write_back`` copies."""
    return (unit.separate_master and unit.dtype in (torch.bfloat16, torch.float16)
            and unit.master.device.type == "cpu" and unit.shard.device.type == "cpu")


class Stepper:
    def __init__(self, config: ZeroConfig, sharding: Sharding, placement: StatePlacement, mesh: MeshInfo,
                 precision: Precision, grads: GradientFlow, units: Sequence[FlatUnit], frozen_units: Sequence[FlatUnit],
                 runs: Sequence[Run], inner: torch.optim.Optimizer, swapper: Optional[NvmeOptimizerState],
                 inflight: StepInFlight) -> None:
        self.config, self.sharding, self.placement, self.mesh = config, sharding, placement, mesh
        self.precision, self.grads, self.inflight = precision, grads, inflight
        self.units, self.all_units = list(units), list(units) + list(frozen_units)
        self.runs, self.inner, self.swapper = list(runs), inner, swapper
        self.fused = isinstance(inner, FusedAdam)
        self.copy_out = {id(r.tensor): r.unit.shard[r.a - r.unit.owned[0]:r.b - r.unit.owned[0]]
                         for r in runs if r.unit.swap is None and copy_out_ok(r.unit)} if self.fused else {}
        self.clip_coef = 1.0
        """A clipping coefficient still to apply (by the fused pass, which needs no extra sweep)."""

    def clip(self, max_norm: float, norm_type: float, error_if_nonfinite: bool) -> torch.Tensor:
        """``clip_grad_norm_``: the global norm of every rank's gradients (each element counted
        once under tensor parallelism), and the gradients clipped by it (clipping.py)."""
        max_norm, norm_type = clipping.check_clip_arguments(max_norm, norm_type)
        overflow = self.grads.finalize()
        total = grad_norm.global_norm(self.units, self.mesh.tp, self.sharding.policy, self.mesh.comm, norm_type,
                                      self.mesh.pp.comm if self.mesh.pp is not None else None)
        coef = clipping.clip_coefficient(total, max_norm, norm_type, error_if_nonfinite and not overflow)
        if coef is not None and (self.fused or self.swapper is not None):  # applied in the update's own pass
            self.clip_coef = float(coef)  # (NVMe: gradients may be in the swap file until their unit's turn)
        elif coef is not None:
            for g in self.grads.owned_grads():
                g.mul_(coef)
        return total

    def sync_hyperparameters(self, user_groups: Sequence[dict]) -> None:
        """The param groups torch code sees (LR schedulers write there) into the inner optimizer's."""
        for user, inner in zip(user_groups, self.inner.param_groups):
            for key, value in user.items():
                if key not in ("params", "optimizer_class"):
                    inner[key] = value
            if "adamw_mode" in inner:
                kernel_choice.sync_fused_group(inner)
                if "adamw_mode" in user:  # (a FusedAdam user's own option; AdamW's users never see it)
                    user["adamw_mode"] = inner["adamw_mode"]

    def groups_back(self, user_groups: Sequence[dict]) -> None:
        """What the inner optimizer's step wrote into its param groups (Prodigy's ``d``,
        schedule-free's weight sums, keys it adds) into the groups torch code sees and
        checkpoints keep, as ZeroRedundancyOptimizer copies its local groups back: the next
        ``sync_hyperparameters`` would otherwise reset them. A key the step left alone is the
        user's object still (``sync_hyperparameters`` put it there), so it is not touched."""
        for user, inner in zip(user_groups, self.inner.param_groups):
            for key, value in inner.items():
                if key in kernel_choice.KERNEL_KEYS and key not in user:
                    continue
                if key not in ("params", "optimizer_class") and (key not in user or user[key] is not value):
                    user[key] = value

    def step(self, user_groups: Sequence[dict], kwargs: dict) -> None:
        if kill_points.ARMED is not None:  # (fault tests only: this step's number, Note [kill points])
            kill_points.steps_done = self.inflight.steps + 1
        try:
            self._step(user_groups, kwargs)
        finally:  # (the quantization errors of this step's collectives: Note [quantized collectives])
            if self.sharding.codecs is not None:
                self.sharding.codecs.end_step()

    def _step(self, user_groups: Sequence[dict], kwargs: dict) -> None:
        overflow = self.grads.finalize()
        if self.sharding.codecs is not None:  # (before a rescale: Note [residuals of a skipped step])
            self.sharding.codecs.settle(applied=not overflow)
        # (here, on the caller's thread: a step in flight overlaps the next forward, which may
        # be gathering a shard torch code had held: Note [parts held for torch code])
        self.placement.release_held()
        if self.precision.scaler is not None:
            before = self.precision.scaler.scale
            self.precision.update(overflow)
            self.grads.set_grad_factor()
            if self.sharding.codecs is not None:  # (Note [residuals under a moving loss scale])
                self.sharding.codecs.rescale(before, self.precision.scaler.scale)
        if overflow or not any(u.grad_valid for u in self.units):  # no gradient: torch.optim skips too
            self.clip_coef = 1.0
            return
        self.sync_hyperparameters(user_groups)
        reducer = self.grads.reducer
        quiet = untouched.untouched_everywhere(reducer.touched, self.mesh.comm, self.mesh.replicas, self.units)
        # (runs none of whose params got a grad: one run per parameter, Note [one run per parameter])
        give_back = untouched.skip_whole_runs(self.units, self.runs, quiet)
        # (a streamed run spans a unit's group: its untouched parameters are put back after the kernel)
        partly = untouched.partly_untouched(self.units, self.runs, quiet) if self.swapper is not None else None
        scale, self.clip_coef = self.clip_coef, 1.0
        updating = False
        try:
            if self.swapper is not None and self.sharding.shard_parameters:  # (stage 3: Note [overlapped step])
                gatherer = self.sharding.require_gatherer()
                if step_in_flight.overlaps(self.config, self.sharding.policy, self.swapper, gatherer):
                    step_in_flight.start_swapped_step(self.inflight, self.all_units, gatherer, self.swapper,
                                                      self.inner.param_groups, self.placement, scale,
                                                      partly)  # returns at once
                    return
            updating = True
            self._update(scale, kwargs, partly)
        except BaseException as exc:
            if updating:  # some units may be updated and others not (Note [failed steps])
                self.inflight.poisoned = exc
            raise
        finally:
            give_back()
        self.groups_back(user_groups)
        self.sharding.gather_params(self.units)
        self.placement.after_step()  # (offload="auto": the step's peak memory against the budget)

    def _update(self, scale: float, kwargs: dict, partly: Optional[dict[int, list[tuple[int, int]]]] = None) -> None:
        if self.swapper is not None:  # (writes swapped units back inside its pass)
            self.swapper.step(self.inner.param_groups, grad_scale=scale, untouched=partly)
        elif self.fused and self.placement.optimizer_on_host:
            self._step_unit_by_unit(scale)
        else:
            if self.fused:  # the bf16/fp16 model copy is written in the same pass
                kernel_choice.step_without_hooks(self.inner, grad_scale=scale, copy_out=self.copy_out, **kwargs)
            else:
                kernel_choice.step_without_hooks(self.inner, **kwargs)
            for unit in self.units:
                if not (self.fused and copy_out_ok(unit)):
                    unit.write_back()
                if kill_points.ARMED is not None:  # (fault tests only: Note [kill points])
                    kill_points.hit("optimizer_step", self.inflight.steps + 1)

    def _step_unit_by_unit(self, scale: float) -> None:
        """offload_optimizer="cpu": the CPU kernel updates one unit at a time and that unit's new
        weights start back to the device (non-blocking, from pinned memory) while the next unit
        is updated, so transfers overlap the CPU work. Each unit's gradient already came to the
        host as its reduction retired. On a CPU-only machine the copy is the kernel's copy-out."""
        by_unit: dict[int, tuple[FlatUnit, set[int]]] = {}
        for r in self.runs:
            by_unit.setdefault(id(r.unit), (r.unit, set()))[1].add(id(r.tensor))
        for unit, ids in by_unit.values():
            kernel_choice.step_without_hooks(self.inner, grad_scale=scale, copy_out=self.copy_out, only=ids)
            if not copy_out_ok(unit):
                unit.write_back(non_blocking=True)
            if kill_points.ARMED is not None:  # (fault tests only: Note [kill points])
                kill_points.hit("optimizer_step", self.inflight.steps + 1)
