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

import contextlib
import inspect
import math
import weakref
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from zeroshard.comm import Comm
from zeroshard.config import ZeroConfig
from zeroshard.layout import NamedParam, Segment, build_layouts, layouts_for
from zeroshard.memory import MemoryReport, tensor_bytes
from zeroshard.optim import registry, state_io
from zeroshard.optim.elementwise import check_elementwise
from zeroshard.optim.flat_unit import FlatUnit, Placement
from zeroshard.optim.grad_links import GradLinks
from zeroshard.optim.module_guard import ModuleGuard
from zeroshard.optim.grad_sync import GradientReducer
from zeroshard.optim.hyperparams import check_inputs
from zeroshard.offload import NvmeOptimizerState
from zeroshard.offload.unit_swap import NvmeUnitStore
from zeroshard.ops import FusedAdam
from zeroshard.optim.params import ParamsLike, normalize_params
from zeroshard.precision import DynamicLossScaler
from zeroshard.stages import policy_for_stage
from zeroshard.stages.stage3.gatherer import ParameterGatherer
from zeroshard.stages.stage3.materialize import swap_meta_parameters
from zeroshard.stages.stage3.units import plan_units

_DTYPES = {None: None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class ZeroOptimizer(torch.optim.Optimizer):
    def __init__(self, model_or_params: ParamsLike, optimizer_class: type, *, stage: int = 2,
                 offload_optimizer: Optional[str] = None, offload_params: Optional[str] = None,
                 nvme_path: Optional[str] = None, mixed_precision: Optional[str] = None,
                 process_group: Optional[dist.ProcessGroup] = None, **kwargs: Any) -> None:
        config_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in ZeroConfig.field_names()}
        self.config = ZeroConfig(stage=stage, offload_optimizer=offload_optimizer,
                                 offload_params=offload_params, nvme_path=nvme_path,
                                 mixed_precision=mixed_precision, **config_kwargs)
        check_elementwise(optimizer_class)
        _check_optimizer_kwargs(optimizer_class, kwargs)
        model_or_params = check_inputs(model_or_params, self.config.stage, kwargs)
        if self.config.stage == 3 and not isinstance(model_or_params, nn.Module):
            raise ValueError("stage=3 partitions parameters by module, so it needs the nn.Module "
                             "itself: ZeroOptimizer(model, ...), not a list of parameters or groups")
        device = None
        meta_shapes: dict[int, torch.Size] = {}
        if isinstance(model_or_params, nn.Module):
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            meta_shapes = swap_meta_parameters(model_or_params, device)
        module, groups, names = normalize_params(model_or_params)
        self.module = module
        self.comm = Comm(process_group)
        # Ranks start from one model, as with DDP and DeepSpeed: rank 0's values everywhere.
        self.comm.broadcast_tensors([t for g in groups for t in g["params"]]
                                    + (list(module.buffers()) if module is not None else []))
        self.policy = policy_for_stage(self.config.stage)
        trainable = _trainable(groups, names, meta_shapes)
        param_dtype = _DTYPES[self.config.mixed_precision] or _single_dtype(trainable)
        if self.config.mixed_precision is not None:  # frozen weights compute in the model dtype too
            for g in groups:
                for p in g["params"]:
                    if not p.requires_grad and p.is_floating_point():
                        p.data = p.data.to(param_dtype)
        reduce_dtype = _DTYPES[self.config.reduce_dtype] or torch.float32
        bucket_numel = max(1, int(self.config.bucket_size_mb * 2**20) // torch.finfo(param_dtype).bits * 8)
        unit_modules: list = []
        if self.policy.shard_parameters:
            groupings, unit_modules = plan_units(module, trainable, self.config.stage3_unit_classes,
                                                 self.config.stage3_unit_numel)
            layouts = layouts_for(groupings, self.comm.world_size)
        else:
            layouts = build_layouts(trainable, bucket_numel, self.comm.world_size)
        placement = Placement(self.config.offload_optimizer, self.config.offload_params)
        self.unit_store: Optional[NvmeUnitStore] = None
        if self.config.offload_optimizer == "nvme":  # gradients, masters (and shards) on NVMe
            self.unit_store = NvmeUnitStore(self.config.nvme_path, self.comm.rank,
                                            swap_shards=self.config.offload_params == "nvme")
            weakref.finalize(self, self.unit_store.close)
        self.units = []
        for layout, members in layouts:  # one unit at a time: a swapped unit leaves memory at once
            unit = FlatUnit(layout, members, self.policy, self.comm.rank, param_dtype,
                            device if meta_shapes else None, placement)
            if self.unit_store is not None:
                self.unit_store.adopt(unit)
            self.units.append(unit)
        self.optimizer_class = optimizer_class
        inner_class, inner_kwargs = _pick_kernel(optimizer_class, kwargs, self.config.fused_adam)
        self.runs, self.inner = _build_inner(inner_class, groups, self.units, inner_kwargs)
        self.swapper: Optional[NvmeOptimizerState] = None
        if self.config.offload_optimizer == "nvme":
            if inner_class.__name__ != "FusedAdam":
                raise ValueError(
                    f"offload_optimizer='nvme' streams Adam/AdamW moments through the fused kernel; "
                    f"{optimizer_class.__name__}(**{kwargs}) does not run on it (use torch.optim.Adam "
                    "or AdamW without amsgrad/foreach/fused/capturable, or offload_optimizer='cpu')")
            slots = self._staging_slots()
            self.swapper = NvmeOptimizerState(self.runs, self.config.nvme_path, self.comm.rank, max_slots=slots)
            self.unit_store.max_in_flight = slots
            self.inner.state = self.swapper
            weakref.finalize(self, self.swapper.close)
        self.gatherer: Optional[ParameterGatherer] = None
        if self.policy.shard_parameters:  # from here on torch code sees sharded parameters
            self.gatherer = ParameterGatherer(self.units, unit_modules, module, self.comm,
                                              self.config.max_live_units)
        show = self.gatherer.visible if self.gatherer is not None else (lambda p: p)
        user_groups = [{**{k: v for k, v in ig.items() if k != "params"}, "params": [show(p) for p in g["params"]]}
                       for g, ig in zip(groups, self.inner.param_groups)]
        super().__init__(user_groups, dict(self.inner.defaults))
        self._zero_initialized = True
        self.param_names = {**names, **{id(show(p)): names[id(p)] for g in groups for p in g["params"]}}
        self.scaler = (DynamicLossScaler(self.config.initial_loss_scale,
                                         growth_interval=self.config.loss_scale_growth_interval)
                       if self.config.mixed_precision == "fp16" else None)
        self.reducer = GradientReducer(self.units, self.comm, reduce_dtype, self.config.max_inflight_buckets)
        self._set_grad_factor()
        self.grad_links = GradLinks(self.units, self.comm, show)
        self.reducer.on_pass_start.append(self._begin_pass)
        self.reducer.on_pass_end.append(self.grad_links.publish)
        self.reducer.register_hooks()
        if self.gatherer is not None:
            self.gatherer.register()
            self.reducer.on_launch.append(self.gatherer.on_unit_reduced)
        if module is not None:
            registry.register(module, self)
            # (a function, not a bound method: torch marks public hooks with an attribute)
            self._load_hook = module.register_load_state_dict_post_hook(
                lambda mod, incompatible: self.model_weights_changed())
            members = [m.param for u in self.units for m in u.members]
            self.module_guard = ModuleGuard(module, members + [show(p) for p in members], "ZeroOptimizer",
                                            [u.flat for u in self.units] if self.gatherer is None else [])
        self._fused_step = isinstance(self.inner, FusedAdam)
        # The fused pass writes the updated master straight into the low-precision shard
        # when both sit on the CPU (the kernel's copy-out); elsewhere write_back copies.
        self._copy_out = {id(r.tensor): r.unit.shard[r.a - r.unit.owned[0]:r.b - r.unit.owned[0]]
                          for r in self.runs if r.unit.swap is None and self._copy_out_ok(r.unit)} if self._fused_step else {}
        self._clip_coef = 1.0  # pending clip coefficient, applied by the fused step
        self._checked_pass = -1  # reducer pass whose overflow flag is cached
        self._overflow = False
        self._scaled_pass = -1

    # -- properties users read -----------------------------------------------------------------
    @property
    def stage(self) -> int:
        return self.config.stage

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
        self.reducer.grad_factor = 1.0 / (self.comm.world_size * self.loss_scale)

    # -- gradients -------------------------------------------------------------------------------
    def _begin_pass(self) -> None:
        """A backward pass starts: what torch code did to ``.grad`` goes into the stores, then
        ``.grad`` is detached so autograd accumulates this pass's gradients afresh."""
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

    def _owned_grads(self) -> list[torch.Tensor]:
        return [u.owned_grad() for u in self.units if u.grad_valid]

    def _map_owned_grads(self, fn: Callable[[torch.Tensor], Any],
                         cached: Optional[Callable[[dict], Any]] = None) -> list[Any]:
        """``fn`` of each owned gradient, reading swapped ones back one unit at a time unless
        ``cached`` computes the same value from the unit's ``grad_stats``."""
        out = []
        for u in self.units:
            if not u.grad_valid:
                continue
            if u.swap is None:
                out.append(fn(u.owned_grad()))
            elif cached is not None and u.grad_stats is not None:
                out.append(cached(u.grad_stats))
            else:
                with u.swap.resident(u, ("grad",)):
                    out.append(fn(u.owned_grad()))
        return out

    def _finalize_grads(self) -> bool:
        """Completes reductions and takes in what torch code did to ``.grad``; returns True
        when the step must be skipped (fp16 overflow)."""
        self.reducer.finalize()
        self.grad_links.reconcile()
        if self.scaler is None:
            return False
        if self._checked_pass != self.reducer.passes:
            if self.reducer.grads_since_clear and self._scaled_pass < self.reducer.passes:
                raise RuntimeError(
                    "mixed_precision='fp16' needs the loss scaled before backward: call "
                    "optimizer.backward(loss) or optimizer.scale_loss(loss).backward() instead "
                    "of loss.backward()")
            local = any(self._map_owned_grads(lambda g: not bool(torch.isfinite(g.sum())),
                                              cached=lambda s: not s["finite"]))
            self._overflow = self.comm.any_true(local)
            self._checked_pass = self.reducer.passes
        return self._overflow

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clips the gradients of all ranks by their global norm and returns that norm.

        With Adam/AdamW on the fused kernel the coefficient is applied inside the optimizer
        pass rather than by rewriting the gradients (one sweep less); a second call before
        ``step`` therefore sees the unclipped gradients again and sets the same coefficient."""
        norm_type = float(norm_type)
        overflow = self._finalize_grads()
        device = self.units[0].grad_store.device if self.units else torch.device("cpu")
        if norm_type == math.inf:
            parts = self._map_owned_grads(lambda g: g.abs().max())
            local = torch.stack(parts).max() if parts else torch.zeros((), device=device)
            total = local.clone()
            if self.policy.shard_optimizer:
                self.comm.all_reduce(total.view(1), op=dist.ReduceOp.MAX)
        else:
            parts = self._map_owned_grads(lambda g: torch.linalg.vector_norm(g, norm_type, dtype=torch.float64)
                                          ** norm_type,
                                          cached=(lambda s: s["sqnorm"]) if norm_type == 2.0 else None)
            local = torch.stack(parts).sum() if parts else torch.zeros((), dtype=torch.float64, device=device)
            if self.policy.shard_optimizer:
                self.comm.all_reduce(local.view(1))
            total = (local ** (1.0 / norm_type)).to(torch.float32)
        if not torch.isfinite(total):
            if error_if_nonfinite and not overflow:
                raise RuntimeError(f"the total norm of order {norm_type} of the gradients is {total.item()}")
            return total
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if self._fused_step:  # applied inside the fused Adam pass: no extra sweep over gradients
            self._clip_coef = float(coef)
        else:  # (swapped gradients imply the fused kernel: offload_optimizer="nvme")
            for g in self._owned_grads():
                g.mul_(coef)
        return total

    # -- the step --------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        overflow = self._finalize_grads()
        if self.scaler is not None:
            self.scaler.update(overflow)
            self._set_grad_factor()
        if overflow or not any(u.grad_valid for u in self.units):  # no gradient: torch.optim skips too
            self._clip_coef = 1.0
            return loss
        self._sync_hyperparameters()
        scale, self._clip_coef = self._clip_coef, 1.0
        if self.swapper is not None:  # (writes swapped units back inside its pass)
            self.swapper.step(self.inner.param_groups, grad_scale=scale)
        elif self._fused_step and self.config.offload_optimizer == "cpu":
            self._step_unit_by_unit(scale)
        else:
            if self._fused_step:  # the bf16/fp16 model copy is written in the same pass
                self.inner.step(grad_scale=scale, copy_out=self._copy_out)
            else:
                self.inner.step()
            for unit in self.units:
                if not (self._fused_step and self._copy_out_ok(unit)):
                    unit.write_back()
        self.gather_params()
        return loss

    def _step_unit_by_unit(self, scale: float) -> None:
        """offload_optimizer="cpu": the CPU kernel updates one unit at a time and that unit's new
        weights start back to the device (non-blocking, from pinned memory) while the next unit
        is updated, so transfers overlap the CPU work. Each unit's gradient already came to the
        host as its reduction retired. On a CPU-only machine the copy is the kernel's copy-out."""
        by_unit: dict[int, tuple[FlatUnit, set[int]]] = {}
        for r in self.runs:
            by_unit.setdefault(id(r.unit), (r.unit, set()))[1].add(id(r.tensor))
        for unit, ids in by_unit.values():
            self.inner.step(grad_scale=scale, copy_out=self._copy_out, only=ids)
            if not self._copy_out_ok(unit):
                unit.write_back(non_blocking=True)

    def gather_params(self) -> None:
        """Makes every rank's full parameters current from the owned ranges (after a step or
        after loading owned pieces from a checkpoint). A collective."""
        if self.policy.gather_after_step:
            works = [self.comm.gather_shards(u.flat) for u in self.units]
            for w in works:
                w.wait()

    def _staging_slots(self) -> int:
        """How many pipeline slots NVMe offload may use within ``offload_buffer_mb``: each holds
        the largest run's moments and the largest unit's swapped parts."""
        if self.config.offload_buffer_mb is None:
            return 3
        moments = max((8 * r.tensor.numel() for r in self.runs), default=0)
        store = self.unit_store
        parts = max((sum(store.tensor_of(u, p).numel() * store.tensor_of(u, p).element_size()
                         for p in store.parts_of(u)) for u in self.units), default=0)
        per_slot = moments + parts
        slots = int(self.config.offload_buffer_mb * 2**20 // max(1, per_slot))
        if slots < 1:
            raise ValueError(
                f"offload_buffer_mb={self.config.offload_buffer_mb} is below one staging slot of "
                f"{per_slot / 2**20:.1f} MiB (the largest unit's moments, gradient and master); raise it, or make "
                "units smaller (bucket_size_mb, or stage3_unit_numel at stage 3)")
        return slots

    @staticmethod
    def _copy_out_ok(unit: FlatUnit) -> bool:
        return (unit.separate_master and unit.dtype in (torch.bfloat16, torch.float16)
                and unit.master.device.type == "cpu" and unit.shard.device.type == "cpu")

    def _sync_hyperparameters(self) -> None:
        for user, inner in zip(self.param_groups, self.inner.param_groups):
            for key, value in user.items():
                if key != "params":
                    inner[key] = value

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.reducer.finalize()  # every rank must finish the collectives it started
        self._clip_coef = 1.0
        had = {id(p) for group in self.param_groups for p in group["params"] if p.grad is not None}
        for unit in self.units:
            unit.clear_grads(set_to_none)
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None
        if not set_to_none:  # as torch: gradients that existed are now zeros
            self.grad_links.publish(only=had)
        else:
            self.grad_links.detach_all()
        self.reducer.grads_since_clear = False

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "_zero_initialized", False):
            raise RuntimeError("ZeroOptimizer lays parameters out at construction; add every param "
                               "group before, by passing the groups to ZeroOptimizer(...)")
        super().add_param_group(param_group)

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's sharded state: pieces keyed by parameter name and flat range. Runs the
        hooks of ``register_state_dict_pre_hook`` / ``register_state_dict_post_hook`` as
        torch.optim does (zeroshard.integrations uses them)."""
        for pre in self._optimizer_state_dict_pre_hooks.values():
            pre(self)
        sd = state_io.sharded_state_dict(self)
        for post in self._optimizer_state_dict_post_hooks.values():
            sd = post(self, sd) or sd
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads a sharded state dict (``state_dict()``) or a consolidated one (the format of
        a plain torch.optim optimizer over the same parameters, e.g. ``consolidated_state_dict()``).
        Runs the ``register_load_state_dict_pre_hook`` / ``_post_hook`` hooks as torch.optim does."""
        for pre in self._optimizer_load_state_dict_pre_hooks.values():
            state_dict = pre(self, state_dict) or state_dict
        if state_io.is_sharded(state_dict):
            state_io.load_sharded(self, state_dict)
        else:
            state_io.load_consolidated(self, state_dict)
        for post in self._optimizer_load_state_dict_post_hooks.values():
            post(self)

    def consolidated_state_dict(self, to_rank: Optional[int] = 0) -> Optional[dict]:
        """The whole optimizer state as a plain ``torch.optim`` state dict (loadable by the same
        optimizer class over ``model.parameters()``). A collective: every rank must call it;
        ``to_rank=None`` returns it on every rank, otherwise other ranks get None."""
        return state_io.consolidated_state_dict(self, to_rank)

    def memory_report(self) -> MemoryReport:
        """Bytes of model state this rank holds, by category. State kept in swap files counts
        as ``offloaded``; its parts read into memory for a moment (the swap pipeline's working
        set) count as ``buffers``, like the gather buffers of stage 3."""
        seen: set[int] = set()
        frozen = sum(tensor_bytes(p, seen) for g in self.param_groups for p in g["params"]
                     if not p.requires_grad)

        def held(unit: FlatUnit, part: str, t: torch.Tensor) -> int:
            return 0 if unit.swapped(part) else tensor_bytes(t, seen)
        staging = sum(tensor_bytes(NvmeUnitStore.tensor_of(u, p), seen)
                      for u in self.units if u.swap is not None for p in u.swap.parts_of(u))
        return MemoryReport(
            parameters=sum(held(u, "shard", u.shard if u.policy.shard_parameters else u.flat)
                           for u in self.units) + frozen,
            gradients=sum(held(u, "grad", u.grad_store) for u in self.units),
            master_weights=sum(held(u, "master", u.master) for u in self.units if u.separate_master),
            optimizer_states=(self.swapper.pool_bytes if self.swapper is not None else
                              sum(tensor_bytes(v, seen) for s in self.inner.state.values()
                                  for v in s.values() if isinstance(v, torch.Tensor))),
            offloaded=((self.swapper.file_bytes if self.swapper is not None else 0)
                       + (self.unit_store.file_bytes if self.unit_store is not None else 0)),
            buffers=(self.reducer.live_bucket_bytes() + (self.gatherer.gathered_bytes() if self.gatherer else 0)
                     + staging),
        )

    def segment_index(self) -> dict[int, tuple[FlatUnit, Segment]]:
        """Where each trainable parameter lives: id(param) -> (unit, segment)."""
        out = {id(m.param): (u, seg) for u in self.units for m, seg in zip(u.members, u.layout.segments)}
        if self.gatherer is not None:  # and the sharded parameters torch code sees between uses
            out.update({id(self.gatherer.visible(m.param)): (u, seg) for u in self.units for m, seg
                        in zip(u.members, u.layout.segments)})
        return out

    def __repr__(self) -> str:
        return (f"ZeroOptimizer(stage={self.stage}, world_size={self.comm.world_size}, "
                f"units={len(self.units)}, optimizer={self.optimizer_class.__name__}, "
                f"runs_on={self.inner.__class__.__name__})")


def _check_optimizer_kwargs(optimizer_class: type, kwargs: dict) -> None:
    try:
        sig = inspect.signature(optimizer_class.__init__)
    except (TypeError, ValueError):
        return
    if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        return
    accepted = {n for n in sig.parameters if n not in ("self", "params")}
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        raise ValueError(
            f"unknown option(s) {unknown}: not a ZeroOptimizer setting ({sorted(ZeroConfig.field_names())}) "
            f"nor an argument of {optimizer_class.__name__} ({sorted(accepted)})")


def _trainable(groups: list[dict], names: dict[int, str], shapes: dict[int, torch.Size]) -> list[NamedParam]:
    seen: dict[int, int] = {}
    devices: dict[str, str] = {}
    out = []
    for gi, group in enumerate(groups):
        for p in group["params"]:
            if not isinstance(p, torch.Tensor) or not p.is_leaf:
                raise TypeError(f"{names.get(id(p), '?')} is not a leaf tensor; optimizers take leaf parameters")
            if id(p) in seen:
                raise ValueError(f"parameter {names[id(p)]!r} appears in param groups {seen[id(p)]} and {gi}; "
                                 "a parameter may belong to one group only")
            seen[id(p)] = gi
            devices.setdefault(str(p.device), names[id(p)])
            if p.requires_grad:
                if not p.is_floating_point():
                    raise TypeError(f"parameter {names[id(p)]!r} has dtype {p.dtype}; only floating "
                                    "point parameters can be trained")
                out.append(NamedParam(names[id(p)], p, gi, shapes.get(id(p))))
    if len(devices) > 1:
        where = ", ".join(f"{d} (e.g. {n!r})" for d, n in devices.items())
        raise ValueError(f"parameters are on different devices: {where}; a ZeroOptimizer needs all "
                         "of its parameters on one device (move the model with .to(device) first)")
    if not out:
        raise ValueError("no parameter requires grad; nothing to optimize")
    return out


def _single_dtype(trainable: list[NamedParam]) -> torch.dtype:
    dtypes = {m.param.dtype for m in trainable}
    if len(dtypes) > 1:
        raise TypeError(f"trainable parameters mix dtypes {sorted(map(str, dtypes))}; cast the model "
                        "to one dtype, or use mixed_precision='bf16'/'fp16' to let zeroshard do it")
    return dtypes.pop()


# torch.optim.Adam/AdamW arguments the fused kernel reproduces exactly; any other (amsgrad,
# foreach, fused, capturable, ...) keeps the user's class so behaviour never silently changes.
_FUSABLE_ARGS = {"lr", "betas", "eps", "weight_decay", "maximize", "decoupled_weight_decay"}


def _pick_kernel(optimizer_class: type, kwargs: dict, enabled: bool) -> tuple[type, dict]:
    """Adam/AdamW run on zeroshard's fused kernel (zeroshard.ops.FusedAdam) when it computes
    the same thing: one pass over memory instead of torch's per-op sweeps on CPU."""
    if not enabled or optimizer_class not in (torch.optim.Adam, torch.optim.AdamW):
        return optimizer_class, kwargs
    if set(kwargs) - _FUSABLE_ARGS or kwargs.get("amsgrad"):
        return optimizer_class, kwargs
    from zeroshard.ops import FusedAdam
    defaults = inspect.signature(optimizer_class.__init__).parameters
    decoupled = kwargs.get("decoupled_weight_decay", optimizer_class is torch.optim.AdamW)
    fused_kwargs = {"weight_decay": defaults["weight_decay"].default, **kwargs, "adamw_mode": bool(decoupled)}
    fused_kwargs.pop("decoupled_weight_decay", None)
    return FusedAdam, fused_kwargs


def _build_inner(optimizer_class: type, groups: list[dict], units: list[FlatUnit],
                 kwargs: dict) -> tuple[list[state_io.Run], torch.optim.Optimizer]:
    """The user's optimizer over this rank's owned ranges: one tensor per unit and group."""
    runs: list[list[torch.Tensor]] = [[] for _ in groups]
    all_runs = []
    for unit in units:
        with unit.swap.sized(unit) if unit.swap is not None else contextlib.nullcontext():
            for g, a, b in unit.layout.group_runs(*unit.owned):
                t = unit.master_range(a, b)
                t.grad = unit.grad_range(a, b)
                runs[g].append(t)
                all_runs.append(state_io.Run(unit, g, a, b, t))
    device = units[0].master.device
    inner_groups = []
    for group, ts in zip(groups, runs):
        # A rank may own nothing of a group; an empty tensor keeps the group (and its
        # hyperparameters) aligned with the user's, and is skipped since it has no grad.
        params = ts or [torch.empty(0, device=device)]
        inner_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    try:
        return all_runs, optimizer_class(inner_groups, **kwargs)
    except TypeError as exc:
        raise TypeError(f"{optimizer_class.__name__}(**{kwargs}) failed: {exc}") from exc
