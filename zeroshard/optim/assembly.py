"""The one place a ZeroOptimizer's engine is put together (Note [assembly]).

Note [assembly]: ``assemble`` builds each policy object once, from the validated config and
what it needs only, and hands each later object the ones it uses: the mesh (MeshInfo:
comm/mesh.py), then the sharding policy (stages/sharding.py) and the precision policy
(precision/precision_policy.py), which lay the units out; the state placement (offload/placement.py)
decides where each unit's parts live before the units exist; then the units, the inner
optimizer over their owned ranges (and the NVMe stream of its state), stage 3's gatherer,
the gradient reducer and the ``.grad`` views, the step. Each object is constructed complete,
with what it uses passed in, and the ``Engine`` last, from all of them: nothing reads or
patches a half-built one, and the facade (zero_optimizer.py) receives it whole. What the
construction attaches to the model or opens on the way (hooks, swap files) is recorded in a
``ConstructionRecord``, from which a construction refused part way is undone (Note [refused
construction] in construction.py). The one object changed after its constructor is the inner
optimizer under NVMe offload: its ``state`` becomes the NVMe stream (torch's own
``load_state_dict`` replaces ``state`` the same way; the stream needs the inner optimizer's runs). A new policy of an
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
from zeroshard.comm.codecs.link_codecs import LinkCodecs
from zeroshard.comm.mesh import HybridMesh, MeshInfo, mesh_info
from zeroshard.resilience.redundancy_options import check_composition as check_redundancy, redundancy_options
from zeroshard.resilience.memory_tier import MemoryTier
from zeroshard.comm.tensor_parallel import local_of
from zeroshard.config import ZeroConfig
from zeroshard.layout import NamedParam
from zeroshard.offload import NvmeOptimizerState
from zeroshard.offload.nvme_generic_state import probe_layouts
from zeroshard.offload.activations.offloader import ActivationOffloader, covered_blocks
from zeroshard.offload.activations.activation_options import ActivationOffload, activation_options
from zeroshard.offload.activations.plan_at_forward import ForwardPlanner, ShapeAgreement
from zeroshard.offload.activations.planned import joint_activations, shape_of
from zeroshard.offload.activations.workload import PlannedActivations
from zeroshard.offload.placement_auto import AutoPlacement
from zeroshard.planner.auto_placement import MemoryBudget
from zeroshard.offload.placement import JointActivations, StatePlacement
from zeroshard.offload.placement_choice import placement_class
from zeroshard.offload.unit_swap import NvmeUnitStore
from zeroshard.ops import FusedAdam
from zeroshard.optim import construction, ddp_check, kernel_choice, ownership, registry, reports
from zeroshard.optim.zero_engine import Engine
from zeroshard.units.run import Run
from zeroshard.units.step_in_flight import StepInFlight
from zeroshard.units.flat_unit import FlatUnit
from zeroshard.grads.links import GradLinks
from zeroshard.grads.reducer import GradientReducer
from zeroshard.grads.flow import GradientFlow
from zeroshard.units.elementwise import update_kind
from zeroshard.optim.inner import GroupedInner, step_without_hooks
from zeroshard.optim.inner_kwargs import check_optimizer_kwargs, separate_optimizer_kwargs
from zeroshard.optim.module_guard import ModuleGuard
from zeroshard.optim.complex_params import check_complex
from zeroshard.optim.params import (ParamsLike, check_inputs, module_of_groups, normalize_params, single_dtype,
                                    trainable_params)
from zeroshard.optim.stepper import Stepper
from zeroshard.optim.teardown import Teardown
from zeroshard.optim.torch_refusals import as_torch_refusal, torch_refusal
from zeroshard.precision.precision_policy import Precision
from zeroshard.units.stage_policy import policy_for_stage
from zeroshard.stages.sharded_tensor import refuse_saved_pieces
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


def configure_from(optimizer_class: type, model_or_params: ParamsLike, module: Optional[nn.Module], args: dict
                   ) -> tuple[ZeroConfig, dict, ParamsLike, Optional[dist.ProcessGroup], object]:
    """``configure`` over the facade's arguments as recorded (its ``build_args``, which a rebuild
    configures from again), with the process group and mesh they name."""
    rest = dict(args)
    options = {k: rest.pop(k) for k in _FACADE_DEFAULTS}
    group, mesh, optimizer_kwargs, given = (rest.pop(k) for k in ("process_group", "mesh", "optimizer_kwargs", "config"))
    config, inner_kwargs, checked = configure(optimizer_class, model_or_params, module, rest, optimizer_kwargs, given,
                                              **options)
    return config, inner_kwargs, checked, group, mesh


def assemble(owner: torch.optim.Optimizer, config: ZeroConfig, optimizer_class: type,
             attached: construction.ConstructionRecord, model_or_params: ParamsLike, module: Optional[nn.Module],
             process_group: Optional[dist.ProcessGroup], mesh: object, kwargs: dict
             ) -> tuple[Engine, Callable[[], None]]:
    """The engine for ``owner`` (the facade: registered, never read), built complete, and what
    ends the construction once the facade's param groups exist (the model's record dropped,
    frozen weights cast). What is attached on the way is recorded in ``attached``."""
    chosen_placement = placement_class(config)  # (chosen once: explicit, auto, or a policy over one)
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
    params = [t for g in groups for t in g["params"]]
    attached.mesh = mesh_ = mesh_info(process_group, mesh, config, params, names)  # Note [hybrid sharding], [hpZ slice order]
    codecs = LinkCodecs(config.codecs)  # (Note [quantized collectives] in zeroshard/comm/codecs/coded.py)
    sharding = Sharding(policy_for_stage(config.stage), mesh_, config, codecs)
    trained = frozenset(id(t) for t in params if t.requires_grad)  # (left out of the groups: not trained)
    frozen = sharding.frozen(module, meta_shapes, trained)  # (Note [frozen units] in stages/stage3/frozen.py)
    whole = frozenset(i for i, g in enumerate(groups)
                      if update_kind(g.get("optimizer_class", optimizer_class)) == "whole")
    check_composition(config, mesh_, [m.name for m in frozen], sorted(whole))
    _start_from_rank0(mesh_, params, frozen, module)
    attached.collectives_done = True  # (from here a refusal is agreed by every rank: Note [agreed construction])
    trainable = trainable_params(groups, names, {**meta_shapes, **mesh_.local_shapes()}, sharding.shard_parameters)
    ownership.check_unclaimed([m.param for m in trainable], names)
    check_complex(config, trainable, sorted(whole))  # (Note [complex parameters])
    precision = Precision(config, single_dtype(trainable) if not config.mixed_precision else torch.float32,
                          pp=mesh_.pp.comm if mesh_.pp else None)
    param_dtype = precision.param_dtype
    all_params = params + [m.param for m in frozen]
    # frozen weights compute in the model dtype too: cast once nothing can refuse (the last step)
    casts = construction.frozen_casts(all_params, param_dtype, trained) if precision.mixed else {}
    if precision.mixed and sharding.shard_parameters:  # (stage 3's empty parameters stay outside the units,
        shapes = {**meta_shapes, **mesh_.local_shapes()}  # but compute in the model dtype all the same)
        casts.update({id(p): param_dtype for p in params if p.requires_grad and p.is_floating_point()
                      and p.dtype != param_dtype and shapes.get(id(p), p.shape).numel() == 0})
    attached.snapshot.keep_data_only_of(lambda p: sharding.shard_parameters or local_of(p).dtype != param_dtype)
    plan = sharding.lay_out(module, trainable, frozen, precision.bucket_numel(config.bucket_size_mb),
                            dtype_of=lambda m: casts.get(id(m.param), m.param.dtype), whole_groups=whole)
    joint = _joint_activations(config, module, param_dtype, mesh_.pp is not None and mesh_.pp.stages > 1)
    placement = chosen_placement(config, sharding.policy, mesh_.comm.rank, optimizer_class, plan.layouts, plan.modules,
                                 param_dtype, construction.as_planned(groups, casts),
                                 device if meta_shapes else None,  # (Note [automatic placement])
                                 frozen_units=[(layout, members, casts.get(id(members[0].param), members[0].param.dtype),
                                                m) for (layout, members), m in zip(plan.frozen_layouts, plan.frozen_modules)],
                                 **({"activations": joint} if joint is not None else {}))
    inflight = StepInFlight()
    units, frozen_units = _build_units(owner, attached, placement, sharding, mesh_, precision, plan, casts,
                                       device if meta_shapes else None, inflight)
    runs, inner, swapper = _build_optimizer_state(owner, attached, config, optimizer_class, placement, mesh_, units,
                                                  groups, kwargs)
    all_units = units + frozen_units
    sharding.start(all_units, plan, module, placement.live_units)  # (stage 3: torch code sees sharded parameters from here)
    show = sharding.visible
    user_groups = [{**{k: v for k, v in kernel_choice.shown_options(g.get("optimizer_class", optimizer_class), ig).items()
                       if k != "params"}, "params": [show(p) for p in g["params"]],
                    **{k: g[k] for k in ("param_names", "optimizer_class") if k in g}}
                   for g, ig in zip(groups, inner.param_groups)]
    reducer, grad_links, grads = _build_gradients(attached, config, mesh_, sharding, precision, placement, units,
                                                  module, params, inflight)
    activations = _build_activations(attached, config, module, mesh_.comm.rank, inflight, placement, param_dtype,
                                     sharding, mesh_.pp.stages if mesh_.pp is not None else 1)
    if activations is not None:  # (Note [activation offload under torch.compile])
        reducer.on_pass_start.append(activations.at_backward)
    module_guard, teardown = _attach(owner, attached, module, mesh_, sharding, reducer, units, all_units, inflight,
                                     (placement.store, swapper))
    engine = Engine(config=config, optimizer_class=optimizer_class, mesh=mesh_, sharding=sharding, placement=placement,
                    precision=precision, module=module, param_names={**names, **{id(show(p)): names[id(p)] for p in params}},
                    units=units, frozen_units=frozen_units, runs=runs, inner=inner, swapper=swapper,
                    unit_store=placement.store, inflight=inflight, reducer=reducer, grad_links=grad_links, grads=grads,
                    stepper=Stepper(config, sharding, placement, mesh_, precision, grads, units, frozen_units, runs, inner,
                                    swapper, inflight),
                    module_guard=module_guard, teardown=teardown, record=attached, user_groups=user_groups,
                    user_defaults=kernel_choice.shown_options(optimizer_class, dict(inner.defaults)),
                    memory_tier=_memory_tier(config, mesh_, placement),
                    activations=activations,
                    codecs=codecs)

    def finish() -> None:
        attached.snapshot.commit()
        construction.cast_frozen(all_params, casts)
    return engine, finish


def _memory_tier(config: ZeroConfig, mesh: MeshInfo, placement: StatePlacement) -> Optional[MemoryTier]:
    """``redundancy="peer"``: the memory tier (what it cannot cover yet is refused here)."""
    options = redundancy_options(config.redundancy)  # (the config holds it normalized: None or PeerRedundancy)
    check_redundancy(options, nvme=placement.store is not None or config.optimizer_swapped or config.automatic,
                     tp=mesh.tp is not None, pp=mesh.pp is not None, hybrid=isinstance(mesh, HybridMesh), world=mesh.comm.world_size)
    return MemoryTier(options, mesh.comm) if options is not None else None


def _start_from_rank0(mesh: MeshInfo, params: list[torch.Tensor], frozen: list[NamedParam],
                      module: Optional[nn.Module]) -> None:
    """Ranks start from one model, as with DDP and DeepSpeed: rank 0's values everywhere (across
    replicas first, then within the shard group; TP shards are each dp group's own)."""
    values = [local_of(t) for t in {**{id(t): t for t in params}, **{id(m.param): m.param for m in frozen}}.values()]
    buffers = list(module.buffers()) if module is not None else []
    values += buffers
    if isinstance(mesh, HybridMesh):
        mesh.replicas.broadcast_tensors(values)
    if mesh.tp is not None:
        mesh.tp.comm.broadcast_tensors([t for t in params if id(t) not in mesh.tp.params] + buffers)
    mesh.comm.broadcast_tensors(values)


def _build_units(owner: torch.optim.Optimizer, attached: construction.ConstructionRecord, placement: StatePlacement,
                 sharding: Sharding, mesh: MeshInfo, precision: Precision, plan: UnitPlan,
                 casts: dict[int, torch.dtype], device: Optional[torch.device], inflight: StepInFlight
                 ) -> tuple[list[FlatUnit], list[FlatUnit]]:
    """The flat units, trainable then frozen, one at a time (a swapped unit leaves memory at
    once), each placed where the placement decides (frozen units too: offload_params, or
    offload="auto"'s plan)."""
    policy, shard_rank = sharding.policy, mesh.comm.shard_rank
    if placement.store is not None:  # gradients, masters (and shards) on NVMe
        attached.files_closers.append(weakref.finalize(owner, placement.store.close))
    units: list[FlatUnit] = []
    frozen_units: list[FlatUnit] = []
    for layout, members in plan.layouts:
        unit = FlatUnit(layout, members, policy, shard_rank, precision.param_dtype, device,
                        placement.of_unit(len(units)), step_in_flight=inflight)
        placement.adopt(unit)
        units.append(unit)
    for layout, members in plan.frozen_layouts:
        unit = FlatUnit(layout, members, policy, shard_rank, casts.get(id(members[0].param), members[0].param.dtype),
                        device, placement.of_frozen(len(frozen_units)), frozen=True)
        placement.adopt_frozen(unit)
        frozen_units.append(unit)
    return units, frozen_units


def _build_optimizer_state(owner: torch.optim.Optimizer, attached: construction.ConstructionRecord, config: ZeroConfig,
                           cls: type, placement: StatePlacement, mesh: MeshInfo, units: list[FlatUnit],
                           groups: list[dict], kwargs: dict
                           ) -> tuple[list[Run], torch.optim.Optimizer, Optional[NvmeOptimizerState]]:
    """The inner optimizer over the owned ranges (its runs), and the NVMe stream of its state
    where the placement puts moments on disk."""
    if placement.re_place_blocker is None and not (
            all(kernel_choice.choose_kernels(cls, kwargs, groups, config.fused_adam))
            and units[0].master.dtype == torch.float32):  # (what build_inner needs to run the fused kernel)
        placement.re_place_blocker = "the options or the dtype keep the optimizer off the fused Adam kernel"
    # (NVMe streams state run by run: there one run per unit and group, Note [one run per parameter])
    runs, inner = kernel_choice.build_inner(cls, kwargs, groups, units, config.fused_adam,
                                            per_parameter=not placement.streams_optimizer)
    if not placement.streams_optimizer:
        return runs, inner, None
    fused = kernel_choice.choose_kernels(cls, kwargs, groups, config.fused_adam)
    if not all(f or update_kind(kernel_choice.group_class(g, cls)) == "whole" for g, f in zip(groups, fused)):
        raise kernel_choice.nvme_kernel_refusal(cls, kwargs, groups, fused)
    parts = inner.parts if isinstance(inner, GroupedInner) else [(inner, list(range(len(groups))))]
    generic = probe_layouts(parts, runs, lambda part: not isinstance(part, FusedAdam))
    slots = reports.staging_slots(config.offload_buffer_mb, runs, units)
    swapper = NvmeOptimizerState(runs, config.nvme_path, mesh.comm.rank, max_slots=slots, generic=generic,
                                 step_fn=step_without_hooks, **placement.state_options(runs, slots))
    attached.files_closers.append(weakref.finalize(owner, swapper.close))
    placement.swapper = swapper
    inner.state = swapper  # type: ignore[assignment]  # (a mapping of the same keys: the state streams through it)
    return runs, inner, swapper


def _build_gradients(attached: construction.ConstructionRecord, config: ZeroConfig, mesh: MeshInfo, sharding: Sharding,
                     precision: Precision, placement: StatePlacement, units: list[FlatUnit], module: Optional[nn.Module],
                     params: list[torch.Tensor], inflight: StepInFlight
                     ) -> tuple[GradientReducer, GradLinks, GradientFlow]:
    """The reducer (gradients into the units as backward runs) and the ``.grad`` views torch code
    sees; their hooks attached (the reducer's subscribers are how the objects hear of a pass)."""
    reducer = GradientReducer(units, mesh.comm, precision.reduce_dtype, config.max_inflight_buckets,
                              replicas=mesh.replicas, codecs=sharding.codecs)
    grad_links = GradLinks(units, mesh.comm, sharding.visible)
    grads = GradientFlow(units, reducer, grad_links, sharding.visible, precision, mesh.comm,
                         mesh.data_parallel_size, inflight)
    reducer.on_pass_start.append(grads.begin_pass)
    if module is None:  # (with a module, the module guard sees DDP's forward)
        reducer.on_pass_start.append(ddp_check.at_first_backward(params))
    reducer.on_pass_end.append(grad_links.publish)
    placement.watch(reducer)
    reducer.register_hooks()
    attached.removers.append(reducer.remove_hooks)
    if sharding.shard_parameters:
        gatherer = sharding.require_gatherer()
        gatherer.register()
        attached.removers.append(gatherer.remove)
        reducer.on_launch.append(gatherer.on_unit_reduced)
    return reducer, grad_links, grads


def _build_activations(attached: construction.ConstructionRecord, config: ZeroConfig, module: Optional[nn.Module],
                       rank: int, inflight: StepInFlight, placement: StatePlacement, param_dtype: torch.dtype,
                       sharding: Sharding, pipeline_stages: int = 1) -> Optional[ActivationOffloader]:
    """Activation offload's hooks on the model (Note [activation offload]), after stage 3's, so a
    block's parameters are gathered when its hooks look at them; under offload="auto" with
    ``PlannedActivations``, on the blocks the plan offloads (Note [activations under the budget])."""
    if isinstance(config.offload_activations, PlannedActivations) and pipeline_stages > 1:
        raise ValueError(f"offload_activations=PlannedActivations(...) with pipeline parallelism ({pipeline_stages} "
                         "stages): the plan fits one micro-batch's activations in the budget, but a pipeline "
                         "schedule holds several micro-batches between their forward and backward (GPipe: all of "
                         "them), so the plan would not hold. Use offload_activations='cpu' or 'nvme' (each "
                         "micro-batch keeps its own records; Note [activation offload under pipeline schedules])")
    if isinstance(config.offload_activations, PlannedActivations):
        offloader = _planned_activations(config, config.offload_activations, module, rank, inflight, placement,
                                         param_dtype, sharding)
        attached.removers.append(offloader.remove)  # (the hooks go with the optimizer, as below)
        return offloader
    options = activation_options(config.offload_activations, config.nvme_path)
    if options is None:
        return None
    if module is None:
        raise ValueError(f"offload_activations={config.offload_activations!r} hooks the model's blocks: give "
                         "ZeroOptimizer the model (an nn.Module), or module=model beside parameter groups")
    device = next((p.device for p in module.parameters()), torch.device(_DEVICE))
    offloader = ActivationOffloader(options, module, rank, device, lambda: inflight.steps)
    attached.removers.append(offloader.remove)
    return offloader


def _joint_activations(config: ZeroConfig, module: Optional[nn.Module], param_dtype: torch.dtype,
                       pipelined: bool) -> Optional[JointActivations]:
    """offload="auto" with a declared ``PlannedActivations`` shape on a model: the activation plan in what
    a state plan leaves, so both are planned together (Note [joint state and activation plan]); not
    under pipeline stages, which ``_build_activations`` refuses with its reason."""
    wanted = config.offload_activations
    if pipelined or not (config.automatic and isinstance(wanted, PlannedActivations) and wanted.micro_batch is not None
                         and module is not None):
        return None
    nvme = None if config.nvme_path is None else str(config.nvme_path)
    names = list(covered_blocks(module, None).values())
    return joint_activations(wanted, shape_of(module, len(names)), names, MemoryBudget.parse(config.memory_budget),
                             nvme, param_dtype)


def _planned_activations(config: ZeroConfig, wanted: PlannedActivations, module: Optional[nn.Module], rank: int,
                         inflight: StepInFlight, placement: StatePlacement, param_dtype: torch.dtype,
                         sharding: Sharding) -> ActivationOffloader:
    if module is None or not isinstance(placement, AutoPlacement):
        raise ValueError("offload_activations=PlannedActivations(...) is planned by offload='auto' on the model's "
                         "blocks: pass offload='auto' with memory_budget, and the model (an nn.Module)")
    nvme = config.nvme_path  # (the planner puts inputs on NVMe only where there is a directory)
    options = ActivationOffload(where="nvme" if nvme else "cpu", path=str(nvme) if nvme else None,
                                prefetch=wanted.prefetch, min_bytes=0, inductor_split=wanted.inductor_split)
    device = next((p.device for p in module.parameters()), torch.device(_DEVICE))
    groups = [g for g in (sharding.mesh.comm, sharding.mesh.replicas) if g is not None]
    planner = ForwardPlanner(wanted, module, covered_blocks(module, None), lambda: placement.plan,
                             MemoryBudget.parse(config.memory_budget), placement.accelerator, nvme, param_dtype,
                             joint=functools.partial(placement.plan_at_first_forward, sharding.require_gatherer),
                             measures_input=sharding.shard_parameters and placement.re_place_blocker is None,
                             agreement=ShapeAgreement(groups, device))  # (Note [one plan on every rank])
    return ActivationOffloader(options, module, rank, device, lambda: inflight.steps, planner=planner)


def _attach(owner: torch.optim.Optimizer, attached: construction.ConstructionRecord, module: Optional[nn.Module],
            mesh: MeshInfo, sharding: Sharding, reducer: GradientReducer, units: list[FlatUnit],
            all_units: list[FlatUnit], inflight: StepInFlight,
            files: tuple[Optional[NvmeUnitStore], Optional[NvmeOptimizerState]]
            ) -> tuple[Optional[ModuleGuard], Teardown]:
    """Ties the engine to the model and to ``owner``: the model's registry entry, a load hook,
    the module guard, the parameters' claim, and the teardown when ``owner`` is closed or
    collected (which must not reference it: teardown.Teardown)."""
    module_guard = None
    if module is not None:
        registry.register(module, owner)  # type: ignore[arg-type]  # (the ZeroOptimizer being built)
        attached.removers.append(functools.partial(registry.unregister, module))
        attached.removers.append(pipeline.defer_reductions(module, reducer.deferred, mesh.pp))  # (Note [deferring a stage's reductions])
        # (a function, not a bound method: torch marks public hooks with an attribute)
        load_hook = module.register_load_state_dict_post_hook(lambda mod, incompatible: sharding.weights_changed(units))
        attached.removers.append(load_hook.remove)
        refuse_hook = module.register_load_state_dict_pre_hook(lambda mod, sd, *rest: refuse_saved_pieces(sd))
        attached.removers.append(refuse_hook.remove)  # (pieces a torch.save wrote: Note [saving pieces])
        members = [m.param for u in all_units for m in u.members]
        module_guard = ModuleGuard(module, members + [sharding.visible(p) for p in members], "ZeroOptimizer",
                                   [u.flat for u in units] if not sharding.policy.shard_parameters else [])
        attached.removers.append(module_guard.remove)
    managed = [m.param for u in all_units for m in u.members]
    ownership.claim(managed, owner)
    # (collected mid-step or with units gathered: the step is joined and stage-3 parameters
    # given back first, before the swap files close: their closers run the teardown first)
    hand_back = (functools.partial(ownership.hand_back_collected, sharding.require_gatherer(), all_units,
                                   mesh.comm.world_size) if sharding.shard_parameters else None)
    attached.teardown = teardown = Teardown(attached.removers, managed, inflight, hand_back)
    weakref.finalize(owner, teardown)
    for f in files:
        if f is not None:
            f.before_close.append(teardown)
    return module_guard, teardown
