"""Models built on the meta device: placeholders at construction, values per unit later.

A meta tensor cannot become a CPU tensor in place (``.data`` refuses the change of tensor
type), so each meta parameter is replaced, once, by a new Parameter holding no data, and
its true shape is remembered. Units then allocate only their owned slices. Values arrive
either from files (``load_safetensors``) or from each module's ``reset_parameters()``,
run one unit at a time on temporary full-size tensors (``init_meta_weights``), so no rank
ever holds more than one unit of full parameters.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from zeroshard.optim.flat_unit import alloc_storage, free_storage, is_allocated
from zeroshard.optim.registry import optimizer_for
from zeroshard.stages.stage3.secondary import params_written


def swap_meta_parameters(model: nn.Module, device: torch.device, frozen_too: bool = False,
                         replaced: Optional[dict[int, nn.Parameter]] = None) -> dict[int, torch.Size]:
    """Replaces meta parameters by empty ones on ``device``; returns true shapes by id.
    ``frozen_too``: stage 3, where frozen parameters are partitioned as well (Note [frozen units]).
    ``replaced`` receives each replacement by ``id`` of the meta parameter (param groups built
    on the meta model follow them: ``follow_replacements``)."""
    replaced = {} if replaced is None else replaced
    shapes: dict[int, torch.Size] = {}
    for mod_name, module in model.named_modules():
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if not p.requires_grad and not frozen_too:
                raise ValueError(
                    f"{mod_name + '.' if mod_name else ''}{name} is a frozen parameter on the meta device; "
                    "below stage 3 zeroshard materialises trainable parameters only: use stage=3 (which partitions "
                    "frozen weights too) or freeze it after loading weights")
            new = replaced.get(id(p))
            if new is None:  # tied weights stay tied: one replacement per meta parameter
                new = nn.Parameter(torch.empty(0, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
                replaced[id(p)] = new
                shapes[id(new)] = p.shape
            module._parameters[name] = new
    _materialize_meta_buffers(model, device)
    return shapes


def follow_replacements(items: list, replaced: dict[int, nn.Parameter]) -> list:
    """Param groups (or a parameter list, or (name, parameter) pairs) built on a meta model,
    with each meta parameter replaced as ``swap_meta_parameters`` replaced it in the model: a
    group's choice of optimizer class (Muon for the matrices) follows the parameter."""
    def follow(entry: object) -> object:
        if isinstance(entry, tuple) and len(entry) == 2:
            return entry[0], replaced.get(id(entry[1]), entry[1])
        return replaced.get(id(entry), entry)
    return [{**item, "params": [follow(e) for e in item["params"]]} if isinstance(item, dict) else follow(item)
            for item in items]


@torch.no_grad()
def _materialize_meta_buffers(model: nn.Module, device: torch.device) -> None:
    """Buffers built on ``meta`` (a rotary embedding's ``inv_freq``) are small: they become real
    here, computed by the Hugging Face model's ``_init_weights`` for modules that own no
    parameters, or left for ``load_safetensors`` when persistent (they are in the files)."""
    init = getattr(model, "_init_weights", None)
    unknown = []
    for mod_name, module in model.named_modules():
        metas = [n for n, b in module._buffers.items() if b is not None and b.is_meta]
        if not metas:
            continue
        for n in metas:
            module._buffers[n] = torch.zeros(module._buffers[n].shape, dtype=module._buffers[n].dtype, device=device)
        if callable(init) and not any(True for _ in module.parameters(recurse=False)):
            init(module)
        else:
            unknown += [f"{mod_name}.{n}" for n in metas if n in module._non_persistent_buffers_set]
    if unknown:
        raise ValueError(f"non-persistent buffer(s) {unknown[:5]} were built on the meta device and nothing here "
                         "can compute them (they are in no weights file); build the model with real buffers, "
                         "e.g. under accelerate.init_empty_weights(include_buffers=False)")


def _owner_modules(model: nn.Module) -> dict[int, list[nn.Module]]:
    owners: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                owners.setdefault(id(p), []).append(module)
    return owners


@torch.no_grad()
def init_meta_weights(model: nn.Module, seed: int = 0) -> None:
    """Initialises a meta-built model's parameters with each owning module's
    ``reset_parameters()`` (or a Hugging Face model's ``_init_weights``), one unit at a time, identically on every rank (unit ``i`` draws
    from ``torch.manual_seed(seed + i)``). Values differ from an eager init's stream."""
    opt = optimizer_for(model)
    if opt is None:
        raise ValueError("init_meta_weights needs the model to be managed by a ZeroOptimizer first")
    owners = _owner_modules(model)
    where = opt.segment_index()
    lora = _lora_layers(model)
    for ui, unit in enumerate(opt.all_units):
        if not unit.needs_init:
            continue
        shown = opt.gatherer.visible if opt.gatherer is not None else (lambda p: p)  # what modules hold now
        modules = {id(mod): mod for m in unit.members for mod in owners.get(id(shown(m.param)), [])}
        temporary: list[nn.Parameter] = []
        if opt.gatherer is not None:  # the initialisers see the unsharded parameters
            opt.gatherer.show(ui, sharded=False)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + unit.layout.index)
            inits: dict[tuple, Any] = {}
            for module in modules.values():  # every parameter gets its temporary before any initialiser
                key, init = _initializer(model, module, lora)
                inits.setdefault(key, init)
                for p in module._parameters.values():
                    if p is not None and id(p) in where and all(p is not t for t in temporary):
                        p.data = torch.empty(where[id(p)][1].shape, dtype=torch.float32, device=unit.device)
                        temporary.append(p)
            for init in inits.values():
                init()
        for m, seg in zip(unit.members, unit.layout.segments):
            unit.load_segment(seg.offset, m.param.detach().reshape(-1).float())
        unit.needs_init = False
        params_written(unit)  # (hpZ: the secondary slice follows)
        for p in temporary:
            owner, seg = where[id(p)]
            restore_parameter(owner, seg, p)
        if opt.gatherer is not None:
            opt.gatherer.show(ui, sharded=True)


def _lora_layers(model: nn.Module) -> dict[int, tuple[nn.Module, str]]:
    """id(lora_A/lora_B module) -> (its PEFT LoRA layer, adapter name)."""
    out: dict[int, tuple[nn.Module, str]] = {}
    for parent in model.modules():
        for attr in ("lora_A", "lora_B"):
            table = getattr(parent, attr, None)
            if isinstance(table, nn.ModuleDict) and callable(getattr(parent, "reset_lora_parameters", None)):
                for adapter, sub in table.items():
                    out[id(sub)] = (parent, adapter)
    return out


def _initializer(model: nn.Module, module: nn.Module, lora: dict[int, tuple[nn.Module, str]]) -> tuple[tuple, Any]:
    """(key, how to initialise one module's own parameters): PEFT's own LoRA initialisation for
    an adapter's modules (A as nn.Linear, B zero), else ``reset_parameters()``, or, for a Hugging
    Face model, the model's ``_init_weights(module)`` (GPT-2's Conv1D has no reset)."""
    if id(module) in lora:
        layer, adapter = lora[id(module)]
        how: object = True
        if hasattr(model, "peft_config"):  # (PEFT's attributes: the module types do not declare them)
            how = getattr(model, "peft_config")[adapter].init_lora_weights
        if how not in (True, False, "gaussian"):
            raise ValueError(f"init_lora_weights={how!r} initialises adapters from the base weights, which a "
                             "meta-device start does not hold whole; use init_lora_weights=True or 'gaussian' "
                             "(or initialise the adapters and load them with zeroshard.load_safetensors)")
        reset_lora = getattr(layer, "reset_lora_parameters")  # (callable: _lora_layers checked)
        return ("lora", id(layer), adapter), lambda: reset_lora(adapter, how)
    if hasattr(module, "reset_parameters"):
        return ("module", id(module)), module.reset_parameters
    init_weights = getattr(model, "_init_weights", None)  # (a Hugging Face model's)
    if callable(init_weights):
        return ("module", id(module)), lambda: init_weights(module)
    raise ValueError(
        f"{type(module).__name__} has no reset_parameters() (and the model no _init_weights), so its "
        "meta parameters cannot be initialised here; load them with zeroshard.load_safetensors(model, path)")


def restore_parameter(unit, seg, p: nn.Parameter) -> None:
    """Points a parameter back at its place in its unit's flat buffer (allocated at stages
    0-2, and at stage 3 only while gathered: a view can only be made of allocated storage)."""
    freed = not is_allocated(unit.flat)
    if freed:
        alloc_storage(unit.flat)
    p.data = unit.flat[seg.offset:seg.end].view(seg.shape)
    if freed:
        free_storage(unit.flat)
