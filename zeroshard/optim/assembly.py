"""The one place a ZeroOptimizer's engine is put together (Note [assembly]).

Note [assembly]: ``assemble`` builds each policy object once, from the validated config and
what it needs only, and hands each later object the ones it uses: the mesh (MeshInfo:
comm/mesh.py), then the sharding policy (stages/sharding.py) and the precision policy
(precision/precision_policy.py), which lay the units out; the state placement (offload/placement.py)
decides where each unit's parts live before the units exist; then the units, the inner
optimizer over their owned ranges (and the NVMe stream of its state), stage 3's gatherer,
the gradient reducer and the ``.grad`` views, the step. Nothing reads a half-built
optimizer: the facade (zero_optimizer.py) only receives the engine, and each object is
recorded on the engine as soon as it exists, so a construction refused part way is undone
from what was built (Note [refused construction] in construction.py). A new policy of an
existing axis is one file that implements the axis' interface (tests/support/placement_example.py
adds a placement this way); a new axis adds its object here.
"""
from __future__ import annotations

import functools
import weakref
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from zeroshard.comm import pipeline
from zeroshard.optim.composition import check_composition
from zeroshard.comm.mesh import MeshInfo, mesh_info
from zeroshard.comm.tensor_parallel import local_of
from zeroshard.config import ZeroConfig
from zeroshard.layout import NamedParam
from zeroshard.offload import NvmeOptimizerState
from zeroshard.offload.nvme_generic_state import probe_layouts
from zeroshard.offload.placement import StatePlacement
from zeroshard.ops import FusedAdam
from zeroshard.optim import construction, ddp_check, kernel_choice, ownership, registry, reports
from zeroshard.optim.zero_engine import Engine
from zeroshard.units.flat_unit import FlatUnit
from zeroshard.grads.links import GradLinks
from zeroshard.grads.reducer import GradientReducer
from zeroshard.grads.flow import GradientFlow
from zeroshard.units.elementwise import update_kind
from zeroshard.optim.inner import GroupedInner, step_without_hooks
from zeroshard.optim.inner_kwargs import check_optimizer_kwargs, separate_optimizer_kwargs
from zeroshard.optim.module_guard import ModuleGuard
from zeroshard.optim.params import (ParamsLike, check_inputs, module_of_groups, normalize_params, single_dtype,
                                    trainable_params)
from zeroshard.optim.stepper import Stepper
from zeroshard.optim.teardown import Teardown
from zeroshard.optim.torch_refusals import as_torch_refusal, torch_refusal
from zeroshard.precision.precision_policy import Precision
from zeroshard.units.stage_policy import policy_for_stage
from zeroshard.stages.sharding import Sharding, UnitPlan
from zeroshard.stages.stage3.materialize import follow_replacements, swap_meta_parameters

# (the optimizer is built on the model's device; a meta-device model is materialised there)
_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# The facade's own defaults for the options it names (a value equal to one is not "given").
_FACADE_DEFAULTS: dict[str, object] = {"stage": 2, "offload_optimizer": None, "offload_params": None,
                                       "nvme_path": None, "mixed_precision": None}


def configure(optimizer_class: type, model_or_params: ParamsLike, module: Optional[nn.Module], kwargs: dict,
              optimizer_kwargs: Optional[dict], given: Optional[ZeroConfig],
              **options: object) -> tuple[ZeroConfig, dict, ParamsLike]:
    """The validated config (``given``, or ``options`` and the zeroshard settings among ``kwargs``),
    the inner optimizer's arguments (the rest, or ``optimizer_kwargs``: a user's ``lr=`` never
    collides with a zeroshard option) and the checked model or parameters; nothing is touched yet."""
    config_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in ZeroConfig.field_names()}
    inner_kwargs = separate_optimizer_kwargs(optimizer_class, config_kwargs, kwargs, optimizer_kwargs)
    if given is not None:
        if not isinstance(given, ZeroConfig):
            raise TypeError(f"config={given!r} must be a zeroshard.ZeroConfig, not a {type(given).__name__}")
        beside = {**{k: v for k, v in options.items() if v != _FACADE_DEFAULTS.get(k)}, **config_kwargs}
        if beside:
            raise ValueError(f"config= holds zeroshard's options, and {', '.join(f'{k}={v!r}' for k, v in beside.items())} "
                             "was given beside it: set it in the ZeroConfig instead (dataclasses.replace(config, ...))")
        config = given
    else:
        config = ZeroConfig(**options, **config_kwargs)  # type: ignore[arg-type]  # (each field checks its value)
    update_kind(optimizer_class)
    check_optimizer_kwargs(optimizer_class, inner_kwargs)
    try:
        checked = check_inputs(model_or_params, config.stage, inner_kwargs, module)
    except (TypeError, ValueError) as ours:  # torch's refusal first, where torch has one
        theirs = torch_refusal(optimizer_class, model_or_params, inner_kwargs)
        if theirs is not None:
            raise as_torch_refusal(theirs, ours) from None
        raise
    theirs = torch_refusal(optimizer_class, checked, inner_kwargs)
    if theirs is not None:
        raise as_torch_refusal(theirs) from None
    if not isinstance(checked, nn.Module):  # (a param group may name its own class: Note [whole-tensor units])
        for i, group in enumerate(g for g in checked if isinstance(g, dict)):
            if "optimizer_class" in group:
                try:
                    update_kind(group["optimizer_class"])
                except (TypeError, ValueError) as exc:
                    raise type(exc)(f"param group {i}: 'optimizer_class': {exc}") from None
    return config, inner_kwargs, checked


def assemble(owner: torch.optim.Optimizer, engine: Engine, model_or_params: ParamsLike, module: Optional[nn.Module],
             process_group: Optional[dist.ProcessGroup], mesh: object, kwargs: dict,
             snapshot: construction.ModelSnapshot) -> Callable[[], None]:
    """Builds ``engine`` for ``owner`` (the facade: registered, never read); returns what ends
    the construction once the facade's param groups exist (the model's record dropped, frozen
    weights cast)."""
    config = engine.config
    placement_class = _placement_class(config)
    device, meta_shapes = None, {}
    if isinstance(model_or_params, nn.Module):
        device = torch.device(_DEVICE)
        meta_shapes = swap_meta_parameters(model_or_params, device, frozen_too=config.stage == 3)
    elif module is not None and config.stage == 3 and any(p.is_meta for p in module.parameters()):
        # (groups on a meta model, e.g. Muon's matrices apart: they follow the replacements, so
        # no parameter silently changes optimizer, as DeepSpeed's under zero.Init did)
        device = torch.device(_DEVICE)
        replaced: dict[int, nn.Parameter] = {}
        meta_shapes = swap_meta_parameters(module, device, frozen_too=True, replaced=replaced)
        model_or_params = follow_replacements(list(model_or_params), replaced)  # type: ignore[arg-type]
    given, groups, names = normalize_params(model_or_params)
    module = given if module is None else module_of_groups(module, given, groups, names,
                                                           allow_outside=config.stage < 3)
    engine.module = module
    params = [t for g in groups for t in g["params"]]
    engine.mesh = mesh_info(process_group, mesh, config, params, names)  # Note [hybrid sharding], [hpZ slice order]
    engine.sharding = sharding = Sharding(policy_for_stage(config.stage), engine.mesh, config)
    trained = frozenset(id(t) for t in params if t.requires_grad)  # (left out of the groups: not trained)
    frozen = sharding.frozen(module, meta_shapes, trained)  # (Note [frozen units] in stages/stage3/frozen.py)
    whole = frozenset(i for i, g in enumerate(groups)
                      if update_kind(g.get("optimizer_class", engine.optimizer_class)) == "whole")
    check_composition(config, engine.mesh, [m.name for m in frozen], sorted(whole))
    _start_from_rank0(engine.mesh, params, frozen, module)
    engine.collectives_done = True  # (from here a refusal is agreed by every rank: Note [agreed construction])
    trainable = trainable_params(groups, names, {**meta_shapes, **engine.mesh.local_shapes()},
                                 sharding.shard_parameters)
    ownership.check_unclaimed([m.param for m in trainable], names)
    engine.precision = precision = Precision(config, single_dtype(trainable) if not config.mixed_precision
                                             else torch.float32, pp=engine.mesh.pp.comm if engine.mesh.pp else None)
    param_dtype = precision.param_dtype
    all_params = params + [m.param for m in frozen]
    # frozen weights compute in the model dtype too: cast once nothing can refuse (the last step)
    casts = construction.frozen_casts(all_params, param_dtype, trained) if precision.mixed else {}
    if precision.mixed and sharding.shard_parameters:  # (stage 3's empty parameters stay outside the units,
        shapes = {**meta_shapes, **engine.mesh.local_shapes()}  # but compute in the model dtype all the same)
        casts.update({id(p): param_dtype for p in params if p.requires_grad and p.is_floating_point()
                      and p.dtype != param_dtype and shapes.get(id(p), p.shape).numel() == 0})
    snapshot.keep_data_only_of(lambda p: sharding.shard_parameters or local_of(p).dtype != param_dtype)
    plan = sharding.lay_out(module, trainable, frozen, precision.bucket_numel(config.bucket_size_mb),
                            dtype_of=lambda m: casts.get(id(m.param), m.param.dtype), whole_groups=whole)
    engine.placement = placement_class(config, sharding.policy, engine.mesh.comm.rank, engine.optimizer_class,
                                      plan.layouts, plan.modules, param_dtype, construction.as_planned(groups, casts),
                                      device if meta_shapes else None,  # (Note [automatic placement])
                                      frozen_units=[(layout, members, casts.get(id(members[0].param),
                                                                                members[0].param.dtype), m)
                                                    for (layout, members), m in zip(plan.frozen_layouts,
                                                                                    plan.frozen_modules)])
    _build_units(owner, engine, plan, casts, device if meta_shapes else None)
    _build_optimizer_state(owner, engine, groups, kwargs)
    sharding.start(engine.all_units, plan, module, engine.placement.live_units)  # (stage 3: torch code sees sharded parameters from here)
    show = sharding.visible
    engine.user_groups = [{**{k: v for k, v in ig.items() if k != "params"}, "params": [show(p) for p in g["params"]],
                           **{k: g[k] for k in ("param_names", "optimizer_class") if k in g}}
                          for g, ig in zip(groups, engine.inner.param_groups)]
    engine.param_names = {**names, **{id(show(p)): names[id(p)] for p in params}}
    _build_gradients(engine, params)
    _attach(owner, engine)
    engine.stepper = Stepper(config, sharding, engine.placement, engine.mesh, precision, engine.grads, engine.units,
                             engine.frozen_units, engine.runs, engine.inner, engine.swapper, engine.inflight)

    def finish() -> None:
        snapshot.commit()
        construction.cast_frozen(all_params, casts)
    return finish


def _placement_class(config: ZeroConfig) -> type[StatePlacement]:
    """The state placement policy: ``config.placement_policy`` (a class in one file, e.g.
    tests/support/placement_example.py) or the built-in one (explicit options, or offload="auto")."""
    cls = config.placement_policy
    if cls is None:
        return StatePlacement
    if not issubclass(cls, StatePlacement):
        raise TypeError(f"placement_policy={cls.__name__} must subclass zeroshard.offload.placement.StatePlacement "
                        "(it is built with the same arguments and overrides what it decides, e.g. of_unit)")
    return cls


def _start_from_rank0(mesh: MeshInfo, params: list[torch.Tensor], frozen: list[NamedParam],
                      module: Optional[nn.Module]) -> None:
    """Ranks start from one model, as with DDP and DeepSpeed: rank 0's values everywhere (across
    replicas first, then within the shard group; TP shards are each dp group's own)."""
    values = [local_of(t) for t in {**{id(t): t for t in params}, **{id(m.param): m.param for m in frozen}}.values()]
    buffers = list(module.buffers()) if module is not None else []
    values += buffers
    if mesh.replicas is not None:
        mesh.replicas.broadcast_tensors(values)
    if mesh.tp is not None:
        mesh.tp.comm.broadcast_tensors([t for t in params if id(t) not in mesh.tp.params] + buffers)
    mesh.comm.broadcast_tensors(values)


def _build_units(owner: torch.optim.Optimizer, engine: Engine, plan: UnitPlan, casts: dict[int, torch.dtype],
                 device: Optional[torch.device]) -> None:
    """The flat units, one at a time (a swapped unit leaves memory at once), each placed where
    the placement decides (frozen units too: offload_params, or offload="auto"'s plan)."""
    placement, policy = engine.placement, engine.sharding.policy
    shard_rank = engine.mesh.comm.shard_rank
    engine.unit_store = store = placement.store  # gradients, masters (and shards) on NVMe
    if store is not None:
        engine.files_closers.append(weakref.finalize(owner, store.close))
    engine.units, engine.frozen_units = [], []
    for layout, members in plan.layouts:
        unit = FlatUnit(layout, members, policy, shard_rank, engine.precision.param_dtype, device,
                        placement.of_unit(len(engine.units)), step_in_flight=engine.inflight)
        placement.adopt(unit)
        engine.units.append(unit)
    for layout, members in plan.frozen_layouts:
        unit = FlatUnit(layout, members, policy, shard_rank, casts.get(id(members[0].param), members[0].param.dtype),
                        device, placement.of_frozen(len(engine.frozen_units)), frozen=True)
        placement.adopt_frozen(unit)
        engine.frozen_units.append(unit)


def _build_optimizer_state(owner: torch.optim.Optimizer, engine: Engine, groups: list[dict], kwargs: dict) -> None:
    """The inner optimizer over the owned ranges, and the NVMe stream of its state where the
    placement puts moments on disk."""
    config, cls = engine.config, engine.optimizer_class
    # (NVMe streams state run by run: there one run per unit and group, Note [one run per parameter])
    engine.runs, engine.inner = kernel_choice.build_inner(cls, kwargs, groups, engine.units, config.fused_adam,
                                                          per_parameter=not engine.placement.streams_optimizer)
    engine.swapper = None
    if engine.placement.streams_optimizer:
        fused = kernel_choice.choose_kernels(cls, kwargs, groups, config.fused_adam)
        if not all(f or update_kind(kernel_choice.group_class(g, cls)) == "whole" for g, f in zip(groups, fused)):
            raise kernel_choice.nvme_kernel_refusal(cls, kwargs, groups, fused)
        parts = engine.inner.parts if isinstance(engine.inner, GroupedInner) else [(engine.inner, list(range(len(groups))))]
        generic = probe_layouts(parts, engine.runs, lambda part: not isinstance(part, FusedAdam))
        slots = reports.staging_slots(config.offload_buffer_mb, engine.runs, engine.units)
        engine.swapper = NvmeOptimizerState(engine.runs, config.nvme_path, engine.mesh.comm.rank, max_slots=slots,
                                            generic=generic, step_fn=step_without_hooks,
                                            **engine.placement.state_options(engine.runs, slots))
        engine.inner.state = engine.swapper  # type: ignore[assignment]  # (a mapping of the same keys)
        engine.files_closers.append(weakref.finalize(owner, engine.swapper.close))


def _build_gradients(engine: Engine, params: list[torch.Tensor]) -> None:
    """The reducer (gradients into the units as backward runs) and the ``.grad`` views torch code sees."""
    config, mesh, units = engine.config, engine.mesh, engine.units
    engine.reducer = reducer = GradientReducer(units, mesh.comm, engine.precision.reduce_dtype,
                                               config.max_inflight_buckets, replicas=mesh.replicas)
    engine.grad_links = GradLinks(units, mesh.comm, engine.sharding.visible)
    engine.grads = GradientFlow(units, reducer, engine.grad_links, engine.sharding.visible, engine.precision,
                                mesh.comm, mesh.data_parallel_size, engine.inflight)
    reducer.on_pass_start.append(engine.grads.begin_pass)
    if engine.module is None:  # (with a module, the module guard sees DDP's forward)
        reducer.on_pass_start.append(ddp_check.at_first_backward(params))
    reducer.on_pass_end.append(engine.grad_links.publish)
    engine.placement.watch(reducer)
    reducer.register_hooks()
    engine.removers.append(reducer.remove_hooks)
    gatherer = engine.sharding.gatherer
    if gatherer is not None:
        gatherer.register()
        engine.removers.append(gatherer.remove)
        reducer.on_launch.append(gatherer.on_unit_reduced)


def _attach(owner: torch.optim.Optimizer, engine: Engine) -> None:
    """Ties the engine to the model and to ``owner``: the model's registry entry, a load hook,
    the module guard, the parameters' claim, and the teardown when ``owner`` is closed or
    collected (which must not reference it: teardown.Teardown)."""
    module, sharding, units = engine.module, engine.sharding, engine.units
    engine.module_guard = None
    if module is not None:
        registry.register(module, owner)  # type: ignore[arg-type]  # (the ZeroOptimizer being built)
        engine.removers.append(functools.partial(registry.unregister, module))
        engine.removers.append(pipeline.defer_reductions(module, engine.reducer.deferred, engine.mesh.pp))  # (Note [deferring a stage's reductions])
        # (a function, not a bound method: torch marks public hooks with an attribute)
        load_hook = module.register_load_state_dict_post_hook(lambda mod, incompatible: sharding.weights_changed(units))
        engine.removers.append(load_hook.remove)
        members = [m.param for u in engine.all_units for m in u.members]
        engine.module_guard = ModuleGuard(module, members + [sharding.visible(p) for p in members], "ZeroOptimizer",
                                          [u.flat for u in units] if not sharding.policy.shard_parameters else [])
        engine.removers.append(engine.module_guard.remove)
    managed = [m.param for u in engine.all_units for m in u.members]
    ownership.claim(managed, owner)
    # (collected mid-step or with units gathered: the step is joined and stage-3 parameters
    # given back first, before the swap files close: their closers run the teardown first)
    gatherer = sharding.gatherer
    hand_back = (functools.partial(ownership.hand_back_collected, gatherer, engine.all_units,
                                   engine.mesh.comm.world_size) if gatherer is not None else None)
    engine.teardown = Teardown(engine.removers, managed, engine.inflight, hand_back)
    weakref.finalize(owner, engine.teardown)
    for files in (engine.unit_store, engine.swapper):
        if files is not None:
            files.before_close.append(engine.teardown)
