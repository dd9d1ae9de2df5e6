"""``init_meta_weights(model)``: values for a model built on the meta device and managed by a
ZeroOptimizer, one unit at a time (the placeholders the optimizer's
construction made are zeroshard/stages/stage3/materialize.py's): each module's ``reset_parameters()``
runs on temporary full-size tensors of one unit, so no rank holds more than one unit in full."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zeroshard.layout import as_real
from zeroshard.optim.registry import optimizer_for
from zeroshard.stages.stage3.secondary import params_written
from zeroshard.units.flat_unit import alloc_storage, free_storage, is_allocated


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
    where = opt.engine.segment_index()
    lora = _lora_layers(model)
    for ui, unit in enumerate(opt.engine.joined().all_units):
        if not unit.needs_init:
            continue
        shown = opt.engine.sharding.visible  # what modules hold now
        modules = {id(mod): mod for m in unit.members for mod in owners.get(id(shown(m.param)), [])}
        temporary: list[nn.Parameter] = []
        if opt.engine.shards_parameters:  # the initialisers see the unsharded parameters
            opt.engine.stage3_gatherer.show(ui, sharded=False)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + unit.layout.index)
            inits: dict[tuple, Any] = {}
            for module in modules.values():  # every parameter gets its temporary before any initialiser
                key, init = _initializer(model, module, lora)
                inits.setdefault(key, init)
                for p in module._parameters.values():
                    if p is not None and id(p) in where and all(p is not t for t in temporary):
                        seg = where[id(p)][1]  # (a complex one's own shape and dtype: Note [complex parameters])
                        p.data = torch.empty(seg.param_shape, dtype=seg.complex_dtype or torch.float32,
                                             device=unit.device)
                        temporary.append(p)
            for init in inits.values():
                init()
        for m, seg in zip(unit.members, unit.layout.segments):
            unit.load_segment(seg.offset, as_real(m.param.detach()).reshape(-1).float())  # (Note [complex parameters])
        unit.needs_init = False
        params_written(unit)  # (hpZ: the secondary slice follows)
        for p in temporary:
            owner, seg = where[id(p)]
            restore_parameter(owner, seg, p)
        if opt.engine.shards_parameters:
            opt.engine.stage3_gatherer.show(ui, sharded=True)


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
    p.data = seg.bind(unit.flat[seg.offset:seg.end])
    if freed:
        free_storage(unit.flat)
