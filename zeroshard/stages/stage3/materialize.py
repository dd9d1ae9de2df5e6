"""Models built on the meta device: placeholders at construction, values per unit later.

A meta tensor cannot become a CPU tensor in place (``.data`` refuses the change of tensor
type), so each meta parameter is replaced, once, by a new Parameter holding no data, and
its true shape is remembered. Units then allocate only their owned slices. Values arrive
either from files (``load_safetensors``) or from each module's ``reset_parameters()``,
run one unit at a time on temporary full-size tensors (``init_meta_weights``, in
zeroshard/model/init_weights.py), so no rank ever holds more than one unit of full parameters.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn



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
