"""ZeroOptimizer: a torch.optim.Optimizer that partitions training state across ranks.

Lifecycle of one step (stages 0-2):
1. construction lays the trainable parameters out in flat units (``FlatUnit``), makes
   every parameter a view into its unit, and builds the user's optimizer class over this
   rank's owned ranges (one tensor per unit and param group);
2. backward: hooks move gradients into buckets that are reduced while backward runs
   (``GradientReducer``); each reduced gradient lands, averaged and unscaled, in the
   unit's fp32 gradient store and ``param.grad`` stays None;
3. ``clip_grad_norm_`` (optional) sees the true global norm across shards;
4. ``step``: hyperparameters are copied from the user-visible param groups (so LR
   schedulers work), the inner optimizer updates the owned ranges, mixed precision copies
   them into the model dtype, and units are gathered so every rank has the new weights.
"""
from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from zeroshard.comm import tensor_parallel
from zeroshard.comm.mesh import comms_from
from zeroshard.comm.tensor_parallel import local_of
from zeroshard.config import ZeroConfig
from zeroshard.io.host_pool import HOST_POOL
from zeroshard.layout import Segment, build_layouts, layouts_for
from zeroshard.memory import MemoryReport
from zeroshard.ops.sqnorm import squared_norm_f64
from zeroshard.optim import (clipping, construction, ddp_check, grad_norm, hooks, kernel_choice, lifecycle, registry,
                             reports, state_io, untouched)
from zeroshard.optim.elementwise import check_elementwise
from zeroshard.optim.flat_unit import FlatUnit
from zeroshard.optim.grad_links import GradLinks
from zeroshard.optim.module_guard import ModuleGuard
from zeroshard.optim import step_in_flight
from zeroshard.optim.step_in_flight import JoinedAttribute, StepInFlight
from zeroshard.optim.grad_sync import GradientReducer
from zeroshard.optim.hyperparams import (check_inputs, check_optimizer_kwargs, nvme_kernel_refusal,
                                         separate_optimizer_kwargs, single_dtype, trainable_params)
from zeroshard.offload import NvmeOptimizerState
from zeroshard.offload.placement import StatePlacement
from zeroshard.offload.unit_swap import NvmeUnitStore
from zeroshard.ops import FusedAdam
from zeroshard.optim.param_state import ParamStateView
from zeroshard.optim.params import ParamsLike, module_of_groups, normalize_params
from zeroshard.precision import DynamicLossScaler
from zeroshard.stages import policy_for_stage
from zeroshard.stages.stage3.gatherer import ParameterGatherer
from zeroshard.stages.stage3.secondary import SecondaryPartition
from zeroshard.stages.stage3.materialize import swap_meta_parameters
from zeroshard.stages.stage3.frozen import frozen_params, split_frozen
from zeroshard.stages.stage3.units import plan_units

_DTYPES = {None: None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class ZeroOptimizer(torch.optim.Optimizer):
    # (read through these, state is never seen with a step half done: Note [overlapped step])
    units = JoinedAttribute()
    runs = JoinedAttribute()
    inner = JoinedAttribute()
    swapper = JoinedAttribute()

    def __init__(self, model_or_params: ParamsLike, optimizer_class: type, *, stage: int = 2,
                 offload_optimizer: Optional[str] = None, offload_params: Optional[str] = None,
                 nvme_path: Optional[str] = None, mixed_precision: Optional[str] = None,
                 process_group: Optional[dist.ProcessGroup] = None, mesh: Any = None,
                 module: Optional[nn.Module] = None, optimizer_kwargs: Optional[dict] = None,
                 **kwargs: Any) -> None:
        # (kept to rebuild the layout in add_param_group)
        self._build_args = (optimizer_class, dict(stage=stage, offload_optimizer=offload_optimizer,
                                                  offload_params=offload_params, nvme_path=nvme_path,
                                                  mixed_precision=mixed_precision, process_group=process_group,
                                                  mesh=mesh, optimizer_kwargs=optimizer_kwargs, **kwargs))
        self._files_closers: list[Any] = []
        self._inflight = StepInFlight()
        config_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in ZeroConfig.field_names()}
        kwargs = separate_optimizer_kwargs(optimizer_class, config_kwargs, kwargs, optimizer_kwargs)
        self.config = ZeroConfig(stage=stage, offload_optimizer=offload_optimizer,
                                 offload_params=offload_params, nvme_path=nvme_path,
                                 mixed_precision=mixed_precision, **config_kwargs)
        check_elementwise(optimizer_class)
        check_optimizer_kwargs(optimizer_class, kwargs)
        model_or_params = check_inputs(model_or_params, self.config.stage, kwargs, module)
        # Everything checkable is checked before the model is touched; the rest is undone on an
        # error (Note [refused construction] in zeroshard/optim/construction.py).
        snapshot = construction.check_and_record(self.config, model_or_params, module, optimizer_class, kwargs)
        try:
            self._build(model_or_params, module, optimizer_class, process_group, mesh, kwargs, snapshot)
        except BaseException as exc:
            construction.abandon(self, snapshot, exc)
            raise

    def _build(self, model_or_params: Any, module: Optional[nn.Module], optimizer_class: type,
               process_group: Optional[dist.ProcessGroup], mesh: Any, kwargs: dict,
               snapshot: construction.ModelSnapshot) -> None:
        device = None
        meta_shapes: dict[int, torch.Size] = {}
        if isinstance(model_or_params, nn.Module):
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            meta_shapes = swap_meta_parameters(model_or_params, device, frozen_too=self.config.stage == 3)
        given, groups, names = normalize_params(model_or_params)
        module = given if module is None else module_of_groups(module, given, groups, names,
                                                               allow_outside=self.config.stage < 3)
        self.module = module
        self.policy = policy_for_stage(self.config.stage)
        # Stage 3 partitions frozen weights too (Note [frozen units] in stages/stage3/frozen.py).
        frozen = frozen_params(module, meta_shapes) if self.policy.shard_parameters else []
        # Note [hybrid sharding], [hpZ slice order]; shard_group_ranks: rows of a hybrid mesh
        self.comm, self.replicas, self.shard_group_ranks = comms_from(process_group, mesh, self.config.hpz)
        params = [t for g in groups for t in g["params"]]
        self.tp = tensor_parallel.detect(params, names, self.comm, self.config, self.replicas is not None,
                                         mesh)
        if self.tp is not None and frozen:
            raise ValueError(f"stage 3 with tensor parallelism partitions trainable parameters only; {len(frozen)} are "
                             f"frozen (e.g. {frozen[0].name!r}): use stage 1-2, or train them")
        # Ranks start from one model, as with DDP and DeepSpeed: rank 0's values everywhere
        # (across replicas first, then within the shard group; TP shards are each dp group's own).
        values = [local_of(t) for t in {**{id(t): t for t in params}, **{id(m.param): m.param for m in frozen}}.values()]
        values += list(module.buffers()) if module is not None else []
        if self.replicas is not None:
            self.replicas.broadcast_tensors(values)
        if self.tp is not None:
            self.tp.comm.broadcast_tensors([t for t in params if id(t) not in self.tp.params]
                                           + (list(module.buffers()) if module is not None else []))
        self.comm.broadcast_tensors(values)
        trainable = trainable_params(groups, names, {**meta_shapes, **(self.tp.local_shapes() if self.tp else {})},
                                     self.policy.shard_parameters)
        lifecycle.check_unclaimed([m.param for m in trainable], names)
        param_dtype = _DTYPES[self.config.mixed_precision] or single_dtype(trainable)
        all_params = [p for g in groups for p in g["params"]] + [m.param for m in frozen]
        # frozen weights compute in the model dtype too: cast once nothing can refuse (the last step)
        casts = construction.frozen_casts(all_params, param_dtype) if self.config.mixed_precision else {}
        snapshot.keep_data_only_of(lambda p: self.policy.shard_parameters or local_of(p).dtype != param_dtype)
        reduce_dtype = _DTYPES[self.config.reduce_dtype] or (torch.float64 if param_dtype == torch.float64
                                                             else torch.float32)
        bucket_numel = max(1, int(self.config.bucket_size_mb * 2**20) // torch.finfo(param_dtype).bits * 8)
        unit_modules: list = []
        if self.policy.shard_parameters:
            groupings, unit_modules, frozen_groupings, frozen_modules = split_frozen(*plan_units(
                module, trainable + frozen, self.config.stage3_unit_classes, self.config.stage3_unit_numel),
                dtype_of=lambda m: casts.get(id(m.param), m.param.dtype))
            layouts = layouts_for(groupings, self.comm.world_size)
        else:
            layouts = build_layouts(trainable, bucket_numel, self.comm.world_size)
        self.placement = StatePlacement(self.config, self.policy, self.comm.rank, optimizer_class,  # or "auto"
                                        layouts, unit_modules, param_dtype, construction.as_planned(groups, casts),
                                        device if meta_shapes else None)  # (Note [automatic placement])
        self.unit_store: Optional[NvmeUnitStore] = self.placement.store  # gradients, masters (and shards) on NVMe
        if self.unit_store is not None:
            self._files_closers.append(weakref.finalize(self, self.unit_store.close))
        self.units = []
        for layout, members in layouts:  # one unit at a time: a swapped unit leaves memory at once
            unit = FlatUnit(layout, members, self.policy, self.comm.shard_rank, param_dtype,
                            device if meta_shapes else None, self.placement.of_unit(len(self.units)))
            self.placement.adopt(unit)
            self.units.append(unit)
        self.frozen_units: list[FlatUnit] = []
        for layout, members in (layouts_for(frozen_groupings, self.comm.world_size, len(self.units))
                                if frozen else []):
            # (frozen weights follow offload_params; offload="auto" places what trains)
            unit = FlatUnit(layout, members, self.policy, self.comm.shard_rank,
                            casts.get(id(members[0].param), members[0].param.dtype),
                            device if meta_shapes else None,
                            self.config.placement, frozen=True)
            if self.unit_store is not None and self.config.params_swapped:
                self.unit_store.adopt(unit)
            self.frozen_units.append(unit)
        self.optimizer_class = optimizer_class
        self.runs, self.inner = kernel_choice.build_inner(optimizer_class, kwargs, groups, self.units,
                                                          self.config.fused_adam)
        self.swapper: Optional[NvmeOptimizerState] = None
        if self.placement.streams_optimizer:
            if kernel_choice.fused_part(self.inner) is None:
                raise nvme_kernel_refusal(optimizer_class, kwargs)
            slots = reports.staging_slots(self.config.offload_buffer_mb, self.runs, self.units)
            self.swapper = NvmeOptimizerState(self.runs, self.config.nvme_path, self.comm.rank, max_slots=slots,
                                              **self.placement.state_options(self.runs, slots))
            self.inner.state = self.swapper
            self._files_closers.append(weakref.finalize(self, self.swapper.close))
        self.gatherer: Optional[ParameterGatherer] = None
        if self.policy.shard_parameters:  # from here on torch code sees sharded parameters
            self.gatherer = ParameterGatherer(self.all_units, unit_modules + (frozen_modules if frozen else []),
                                              module, self.comm, self.config.max_live_units)
            self.gatherer.secondary = SecondaryPartition(self.all_units, self.comm) if self.config.hpz else None
        self._show = show = self.gatherer.visible if self.gatherer is not None else (lambda p: p)
        user_groups = [{**{k: v for k, v in ig.items() if k != "params"}, "params": [show(p) for p in g["params"]],
                        **({"param_names": g["param_names"]} if "param_names" in g else {})}
                       for g, ig in zip(groups, self.inner.param_groups)]
        super().__init__(user_groups, dict(self.inner.defaults))
        self.state = ParamStateView(self)  # (torch's per-parameter dict; zeroshard's lives in the runs)
        self._zero_initialized = True
        self.param_names = {**names, **{id(show(p)): names[id(p)] for g in groups for p in g["params"]}}
        self.scaler = (DynamicLossScaler(self.config.initial_loss_scale,
                                         growth_interval=self.config.loss_scale_growth_interval)
                       if self.config.mixed_precision == "fp16" else None)
        self.reducer = GradientReducer(self.units, self.comm, reduce_dtype, self.config.max_inflight_buckets)
        self.reducer.replicas = self.replicas
        self._set_grad_factor()
        self.grad_links = GradLinks(self.units, self.comm, show)
        self.reducer.on_pass_start.append(lifecycle.weak_method(self._begin_pass))  # (del opt frees it)
        if module is None:  # (with a module, the module guard sees DDP's forward)
            self.reducer.on_pass_start.append(ddp_check.at_first_backward(params))
        self.reducer.on_pass_end.append(self.grad_links.publish)
        self.reducer.on_pass_end.append(HOST_POOL.trim)  # (Note [reused host buffers])
        self.placement.watch(self.reducer)
        self.reducer.register_hooks()
        if self.gatherer is not None:
            self.gatherer.register()
            self.reducer.on_launch.append(self.gatherer.on_unit_reduced)
        if module is not None:
            registry.register(module, self)
            # (a function, not a bound method: torch marks public hooks with an attribute; weak: del opt frees it)
            weights_changed = lifecycle.weak_method(self.model_weights_changed)
            self._load_hook = module.register_load_state_dict_post_hook(lambda mod, incompatible: weights_changed())
            members = [m.param for u in self.all_units for m in u.members]
            self.module_guard = ModuleGuard(module, members + [show(p) for p in members], "ZeroOptimizer",
                                            [u.flat for u in self.units] if self.gatherer is None else [])
        self._fused_step = isinstance(self.inner, FusedAdam)
        managed = [m.param for u in self.all_units for m in u.members]
        lifecycle.claim(managed, self)
        removers = [self.reducer.remove_hooks] + ([self.gatherer.remove] if self.gatherer is not None else [])
        if module is not None:
            removers += [self.module_guard.remove, self._load_hook.remove,
                         functools.partial(registry.unregister, module)]
        # (collected mid-step or with units gathered: the step is joined and stage-3 parameters
        # given back first, before the swap files close: their closers run the teardown first)
        hand_back = (functools.partial(lifecycle.hand_back_collected, self.gatherer, self.all_units,
                                       self.comm.world_size) if self.gatherer is not None else None)
        self._teardown = lifecycle.Teardown(removers, managed, self._inflight, hand_back)
        weakref.finalize(self, self._teardown)
        for files in (self.unit_store, self.swapper):
            if files is not None:
                files.before_close.append(self._teardown)
        self.closed = False
        # The fused pass writes the updated master straight into the low-precision shard
        # when both sit on the CPU (the kernel's copy-out); elsewhere write_back copies.
        self._copy_out = {id(r.tensor): r.unit.shard[r.a - r.unit.owned[0]:r.b - r.unit.owned[0]]
                          for r in self.runs if r.unit.swap is None and self._copy_out_ok(r.unit)} if self._fused_step else {}
        for unit in self.units:  # (what reads a unit's parts waits for a step in flight)
            unit.step_in_flight = self._inflight
        self._clip_coef = 1.0  # pending clip coefficient, applied by the fused step
        self._checked_pass = -1  # reducer pass whose overflow flag is cached
        self._overflow = False
        self._scaled_pass = -1
        snapshot.commit()
        construction.cast_frozen(all_params, casts)

    # -- properties users read -----------------------------------------------------------------
    @property
    def stage(self) -> int:
        return self.config.stage

    @property
    def steps_done(self) -> int:
        """Optimizer steps completed (skipped ones too: fp16 overflow, no gradient), counted from
        construction or from the step of the checkpoint ``load_checkpoint`` loaded. A step is
        whole or not begun even under Ctrl-C, so this is the step to save after an interrupt
        (README: "Save on interrupt")."""
        return self._inflight.steps

    @property
    def all_units(self) -> list[FlatUnit]:
        """Trainable units, then frozen ones (stage 3: Note [frozen units])."""
        return self.units + getattr(self, "frozen_units", [])

    @property
    def data_parallel_size(self) -> int:
        """Ranks whose gradients are averaged: the shard group times its replicas."""
        return self.comm.world_size * (self.replicas.world_size if self.replicas is not None else 1)

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler else 1.0

    # -- loss scaling ----------------------------------------------------------------------------
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on (multiplied by the fp16 loss scale; unchanged otherwise)."""
        self._scaled_pass = self.reducer.passes + 1
        return loss * self.scaler.scale if self.scaler else loss

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        self.scale_loss(loss).backward(**kwargs)

    def _set_grad_factor(self) -> None:
        # Gradients are averaged over ranks and unscaled as each reduction retires.
        self.reducer.grad_factor = 1.0 / (self.data_parallel_size * self.loss_scale)

    # -- gradients -------------------------------------------------------------------------------
    def _begin_pass(self) -> None:
        """A backward pass starts: what torch code did to ``.grad`` goes into the stores, then
        ``.grad`` is detached so autograd accumulates this pass's gradients afresh."""
        self._inflight.join()
        self._note_assigned()
        self.grad_links.reconcile()
        self.grad_links.detach_all()

    def model_weights_changed(self) -> None:
        """The model's parameters were written from outside (``model.load_state_dict``, a
        weights-only ``load_checkpoint``): the fp32 masters of stages 0-2 take the new values, or
        the next step would write the old ones back. (Stage-3 parameters write through their
        unit already: Note [sharded tensor ops].)"""
        if self.gatherer is not None:
            return
        with torch.no_grad():
            for unit in self.units:
                if unit.separate_master:
                    lo, hi = unit.owned
                    unit.load_segment(lo, unit.flat[lo:hi].float())

    def _note_assigned(self) -> None:
        """A ``.grad`` that torch code assigned (not the published view) is a gradient too."""
        published = self.grad_links._published
        for ui, unit in enumerate(self.units):
            for si, m in enumerate(unit.members):
                p = self._show(m.param)  # the parameter torch code holds
                if p.grad is not None and p.grad is not published.get(id(p)):
                    self.reducer.mark_touched(ui, si)

    def _owned_grads(self) -> list[torch.Tensor]:
        return [u.owned_grad() for u in self.units if u.grad_valid]

    def _finalize_grads(self) -> bool:
        """Completes reductions and takes in what torch code did to ``.grad``; returns True
        when the step must be skipped (fp16 overflow)."""
        self.reducer.finalize()
        self._note_assigned()
        self.grad_links.reconcile()
        if self.scaler is None:
            return False
        if self._checked_pass != self.reducer.passes:
            if self.reducer.grads_since_clear and self._scaled_pass < self.reducer.passes:
                raise RuntimeError(
                    "mixed_precision='fp16' needs the loss scaled before backward: call "
                    "optimizer.backward(loss) or optimizer.scale_loss(loss).backward() instead "
                    "of loss.backward()")
            # (the test FlatUnit.note_grad_stats notes for swapped gradients, so both agree)
            local = any(grad_norm.map_owned_grads(self.units, lambda g: not bool(torch.isfinite(squared_norm_f64(g))),
                                              cached=lambda s: not s["finite"]))
            self._overflow = self.comm.any_true(local)
            self._checked_pass = self.reducer.passes
        return self._overflow

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clips the gradients of all ranks by their global norm and returns that norm
        (zeroshard/optim/clipping.py)."""
        max_norm, norm_type = clipping.check_clip_arguments(max_norm, norm_type)
        overflow = self._finalize_grads()
        # (tensor parallelism: each element counted once)
        total = grad_norm.global_norm(self.units, self.tp, self.policy, self.comm, norm_type)
        coef = clipping.clip_coefficient(total, max_norm, norm_type, error_if_nonfinite and not overflow)
        if coef is not None and self._fused_step:  # applied inside the fused Adam pass: no extra sweep
            self._clip_coef = float(coef)
        elif coef is not None:  # (swapped gradients imply the fused kernel: offload_optimizer="nvme")
            for g in self._owned_grads():
                g.mul_(coef)
        return total

    # -- the step --------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
        """One optimizer step on every rank. ``kwargs`` go to the inner optimizer's step, as
        ZeroRedundancyOptimizer passes them to its local optimizer."""
        if self.closed:
            raise RuntimeError("this ZeroOptimizer was closed (close()); build a new one to train on")
        self._inflight.join()
        self._inflight.check("optimizer.step()")  # (Note [failed steps])
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with lifecycle.interrupts_held():  # a step is whole or not begun (Note [saving between steps])
            self._apply_step(kwargs)
            self._inflight.steps += 1
        return loss

    def _apply_step(self, kwargs: dict) -> None:
        overflow = self._finalize_grads()
        if self.scaler is not None:
            self.scaler.update(overflow)
            self._set_grad_factor()
        if overflow or not any(u.grad_valid for u in self.units):  # no gradient: torch.optim skips too
            self._clip_coef = 1.0
            return
        self._sync_hyperparameters()
        quiet = untouched.untouched_everywhere(self.reducer.touched, self.comm, self.replicas, self.units)
        give_back = untouched.skip_whole_runs(self.units, self.runs, quiet)  # (runs none of whose params got a grad)
        restore = (untouched.freeze(self.units, self.runs, self.inner.state, quiet) if self.swapper is None
                   else lambda: None)  # (NVMe offload: the others of a stepped run step with a zero gradient)
        scale, self._clip_coef = self._clip_coef, 1.0
        updating = False
        try:
            if step_in_flight.overlaps(self.config, self.policy, self.swapper, self.gatherer):  # (Note [overlapped step])
                step_in_flight.start_swapped_step(self._inflight, self.all_units, self.gatherer, self.swapper,
                                                  self.inner.param_groups, self.placement, scale)  # returns at once
                return
            updating = True
            if self.swapper is not None:  # (writes swapped units back inside its pass)
                self.swapper.step(self.inner.param_groups, grad_scale=scale)
            elif self._fused_step and self.config.optimizer_on_host:
                self._step_unit_by_unit(scale)
            else:
                if self._fused_step:  # the bf16/fp16 model copy is written in the same pass
                    kernel_choice.step_without_hooks(self.inner, grad_scale=scale, copy_out=self._copy_out,
                                                     **kwargs)
                else:
                    kernel_choice.step_without_hooks(self.inner, **kwargs)
                for unit in self.units:
                    if not (self._fused_step and self._copy_out_ok(unit)):
                        unit.write_back()
        except BaseException as exc:
            if updating:  # some units may be updated and others not (Note [failed steps])
                self._inflight.poisoned = exc
            raise
        finally:
            give_back()
        restore()
        self.gather_params()
        HOST_POOL.trim()
        self.placement.after_step()  # (offload="auto": the step's peak memory against the budget)

    def finish_step(self) -> None:
        """Waits for a step still updating in the background (Note [overlapped step]) and
        raises its error, if any. Calls that need the state do this themselves."""
        self._inflight.join()

    def _step_unit_by_unit(self, scale: float) -> None:
        """offload_optimizer="cpu": the CPU kernel updates one unit at a time and that unit's new
        weights start back to the device (non-blocking, from pinned memory) while the next unit
        is updated, so transfers overlap the CPU work. Each unit's gradient already came to the
        host as its reduction retired. On a CPU-only machine the copy is the kernel's copy-out."""
        by_unit: dict[int, tuple[FlatUnit, set[int]]] = {}
        for r in self.runs:
            by_unit.setdefault(id(r.unit), (r.unit, set()))[1].add(id(r.tensor))
        for unit, ids in by_unit.values():
            kernel_choice.step_without_hooks(self.inner, grad_scale=scale, copy_out=self._copy_out, only=ids)
            if not self._copy_out_ok(unit):
                unit.write_back(non_blocking=True)

    def gather_params(self) -> None:
        """Makes every rank's full parameters current from the owned ranges (after a step or
        after loading owned pieces from a checkpoint). A collective."""
        if self.policy.gather_after_step:
            works = [self.comm.gather_shards(u.flat) for u in self.units]
            for w in works:
                w.wait()
        elif self.gatherer is not None and self.gatherer.secondary is not None:
            sec = self.gatherer.secondary  # hpZ: across nodes once per step (Note [hpZ secondary partition])
            sec.rebuild([i for i in range(len(sec.units)) if i < len(self.units) or sec.stale[i]])  # (frozen: if written)

    @staticmethod
    def _copy_out_ok(unit: FlatUnit) -> bool:
        return (unit.separate_master and unit.dtype in (torch.bfloat16, torch.float16)
                and unit.master.device.type == "cpu" and unit.shard.device.type == "cpu")

    def _sync_hyperparameters(self) -> None:
        for user, inner in zip(self.param_groups, self.inner.param_groups):
            for key, value in user.items():
                if key != "params":
                    inner[key] = value
            if "adamw_mode" in inner:
                kernel_choice.sync_fused_group(inner)
                user["adamw_mode"] = inner["adamw_mode"]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.reducer.finalize()  # every rank must finish the collectives it started
        self._clip_coef = 1.0
        had = {id(p) for group in self.param_groups for p in group["params"] if p.grad is not None}
        units = self._units
        # (a step in flight still reads the stores: they are marked empty once it is joined)
        if not (set_to_none and self._inflight.defer(lambda: [u.clear_grads(True) for u in units])):
            self._inflight.join()
            for unit in units:
                unit.clear_grads(set_to_none)
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None
        self.reducer.clear_touched()
        if not set_to_none:  # as torch: gradients that existed are now zeros (and are stepped)
            for ui, unit in enumerate(self.units):
                for si, m in enumerate(unit.members):
                    if id(m.param) in had:
                        self.reducer.mark_touched(ui, si)
            self.grad_links.publish(only=had)
        else:
            self.grad_links.detach_all()
        self.reducer.grads_since_clear = False

    def add_param_group(self, param_group: dict) -> None:
        """As torch.optim: the new parameters join with their own hyperparameters, existing state
        is kept. Units are laid out at construction, so this rebuilds them (a collective costing
        one copy of the optimizer state per rank for a moment: lifecycle.rebuild_with_group)."""
        if not getattr(self, "_zero_initialized", False):
            return super().add_param_group(param_group)  # (torch's constructor adds the first groups)
        if not isinstance(param_group, dict) or "params" not in param_group:
            raise TypeError(f"param_group must be a dict with 'params', got {type(param_group).__name__}")
        lifecycle.rebuild_with_group(self, param_group)

    # -- lifetime --------------------------------------------------------------------------------
    def close(self) -> None:
        """Detaches from the model: removes the gradient hooks, stage-3 forward hooks and the
        module guard, so the parameters can be given to a new optimizer. At stage 3 every
        parameter gets its full values back first (a collective: every rank must call it).
        Garbage collection of the optimizer does the same, except that stage-3 parameters,
        which then have no values left, must be reloaded."""
        if self.closed:
            return
        self._inflight.join()
        self.reducer.finalize()
        if self.gatherer is not None:
            lifecycle.hand_back_stage3(self.gatherer, self.all_units)
        self.closed = True
        self._teardown(handed_back=True)

    def __deepcopy__(self, memo: dict) -> "ZeroOptimizer":
        raise TypeError(
            "a ZeroOptimizer cannot be deep-copied: it owns the model's parameter storage (every "
            "parameter is a view of its flat buffers), hooks on those parameters and a process group, "
            "none of which a copy could share or duplicate. Save opt.state_dict() (or "
            "consolidated_state_dict()) and load it into a new ZeroOptimizer instead")

    def __copy__(self) -> "ZeroOptimizer":
        raise TypeError("a ZeroOptimizer cannot be copied (see copy.deepcopy); build a new one and "
                        "load_state_dict(opt.state_dict())")

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's sharded state: pieces keyed by parameter name and flat range."""
        return hooks.with_state_dict_hooks(self, lambda: state_io.sharded_state_dict(self))

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads a sharded state dict (``state_dict()``) or a consolidated one (the format of
        a plain torch.optim optimizer over the same parameters, e.g. ``consolidated_state_dict()``)."""
        def apply(sd: dict) -> None:
            if state_io.is_sharded(sd):
                state_io.load_sharded(self, sd)
            else:
                state_io.load_consolidated(self, sd)
        hooks.with_load_state_dict_hooks(self, state_dict, apply)
        lifecycle.state_restored(self)  # (Note [failed steps])

    def consolidated_state_dict(self, to_rank: Optional[int] = 0) -> Optional[dict]:
        """The whole optimizer state as a plain ``torch.optim`` state dict (loadable by the same
        optimizer class over ``model.parameters()``). A collective: every rank must call it;
        ``to_rank=None`` returns it on every rank, otherwise other ranks get None."""
        return state_io.consolidated_state_dict(self, to_rank)

    def memory_report(self) -> MemoryReport:
        """Bytes of model state this rank holds, by category (zeroshard/optim/reports.py)."""
        return reports.memory_report(self)

    def placement_report(self, micro_batches: int = 1) -> dict:  # where state lives, why: offload/placement.py
        return self.placement.report(self.runs, self.swapper, micro_batches)

    def comm_report(self, reset: bool = False) -> dict[str, dict]:
        """``memory_report``'s sibling: what this rank's collectives moved since construction
        (or the last ``reset``), by kind: calls, bytes and the group dimension crossed."""
        return reports.comm_report(self.comm, self.replicas, self.tp, reset)

    def segment_index(self) -> dict[int, tuple[FlatUnit, Segment]]:
        """Where each managed parameter lives (frozen ones too): id(param) -> (unit, segment)."""
        out = {id(m.param): (u, seg) for u in self.all_units for m, seg in zip(u.members, u.layout.segments)}
        if self.gatherer is not None:  # and the sharded parameters torch code sees between uses
            out.update({id(self.gatherer.visible(m.param)): (u, seg) for u in self.all_units for m, seg
                        in zip(u.members, u.layout.segments)})
        return out

    def __repr__(self) -> str:
        return (f"ZeroOptimizer(stage={self.stage}, world_size={self.comm.world_size}, "
                f"units={len(self.units)}, optimizer={self.optimizer_class.__name__}, "
                f"runs_on={self.inner.__class__.__name__})")
