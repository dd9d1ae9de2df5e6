"""Normalising what users pass as "parameters" into named param groups, and the groups a rebuild
for ``add_param_group`` starts from."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Sequence, Union

import torch
from torch import nn

if TYPE_CHECKING:
    from zeroshard.units.flat_unit import FlatUnit

ParamsLike = Union[nn.Module, Iterable[torch.Tensor], Iterable[tuple[str, torch.Tensor]], Iterable[dict]]


def normalize_params(model_or_params: ParamsLike) -> tuple[Optional[nn.Module], list[dict], dict[int, str]]:
    """Returns (module or None, param groups with 'params' lists, name by id(param)).

    Names come from ``named_parameters()`` for a module or from ``(name, tensor)`` pairs;
    otherwise ``param.<i>`` by position, which is stable as long as the same groups are
    built in the same order (what checkpoints rely on).
    """
    if isinstance(model_or_params, nn.Module):
        module = model_or_params
        sparse = [n for n, m in module.named_modules() if getattr(m, "sparse", False) is True]
        if sparse:
            raise ValueError(f"module(s) {sparse[:3]} produce sparse gradients (sparse=True); ZeroOptimizer "
                             "reduces and shards dense flat buffers: build them with sparse=False")
        named = list(module.named_parameters())
        if not named:
            raise ValueError(f"{type(module).__name__} has no parameters to optimize")
        return module, [{"params": [p for _, p in named]}], {id(p): n for n, p in named}
    if isinstance(model_or_params, torch.Tensor):
        raise TypeError("params must be an iterable of tensors or a module, got a single Tensor; "
                        "wrap it in a list")
    items = list(model_or_params)
    if not items:
        raise ValueError("ZeroOptimizer got an empty parameter list")
    raw_groups = items if isinstance(items[0], dict) else [{"params": items}]
    groups: list[dict] = []
    names: dict[int, str] = {}
    position = 0
    for gi, raw in enumerate(raw_groups):
        if not isinstance(raw, dict):
            raise TypeError(f"param group {gi} is a {type(raw).__name__}; mix of groups and tensors")
        group: dict[str, Any] = {k: v for k, v in raw.items() if k != "params"}
        params = raw["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        plain, given_names = [], []
        for entry in params:
            if isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[1], torch.Tensor):
                name, p = entry
                names[id(p)] = str(name)
                given_names.append(str(name))
            elif isinstance(entry, torch.Tensor):
                p = entry
                names.setdefault(id(p), f"param.{position}")
            else:
                raise TypeError(f"param group {gi} holds a {type(entry).__name__}; expected tensors "
                                "or (name, tensor) pairs")
            plain.append(p)
            position += 1
        group["params"] = plain
        if given_names:  # as torch.optim: a group is named throughout or not at all
            if len(given_names) != len(plain):
                raise ValueError(f"param group {gi}: all optimizer params should be with/without names; "
                                 f"{len(plain) - len(given_names)} of {len(plain)} have no name")
            group["param_names"] = given_names
        if groups and ("param_names" in group) != ("param_names" in groups[0]):
            raise ValueError(f"all optimizer param groups should be with/without names: group {gi} is "
                             f"{'with' if 'param_names' in group else 'without'} names, group 0 is not")
        groups.append(group)
    return None, groups, names


def module_of_groups(module: nn.Module, given: Optional[nn.Module], groups: list[dict],
                     names: dict[int, str], allow_outside: bool = False) -> nn.Module:
    """``module=`` with param groups (stage 3 plans units by module, as DeepSpeed's
    ``initialize(model=..., model_parameters=groups)``): every parameter of the groups must be
    the module's (``allow_outside``: stages 0-2, where units do not follow modules). A trainable
    parameter of the module left out of every group is not trained, as with torch.optim (stage 3
    holds it in a frozen unit: Note [frozen units]); names become the module's."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    if given is not None and given is not module:
        raise ValueError("module= names another model than the one passed as parameters; pass one of them")
    named = dict(module.named_parameters())
    by_id = {id(p): n for n, p in named.items()}
    in_groups = {id(p) for g in groups for p in g["params"]}
    strangers = [names.get(i, "?") for i in in_groups if i not in by_id]
    if strangers and not allow_outside:
        raise ValueError(f"param groups hold {len(strangers)} tensor(s) that are not parameters of module= "
                         f"{type(module).__name__} (e.g. {strangers[:3]})")
    if any(p.is_meta for g in groups for p in g["params"]):
        raise ValueError("a meta-device model takes ZeroOptimizer(model, ...) (its parameters are replaced "
                         "while being materialised, so groups built before would not see them)")
    names.update({i: n for i, n in by_id.items() if i in in_groups})
    return module


def groups_with(visible: Callable[[torch.Tensor], torch.Tensor], units: Sequence["FlatUnit"],
                param_groups: list[dict], param_group: dict) -> list[dict]:
    """The param groups a rebuild for ``add_param_group`` builds from (Note [rebuild on
    add_param_group] in zero_optimizer.py): the current ones plus ``param_group``, each naming
    the model's own parameters (stage 3 shows torch code other objects between uses)."""
    shown = {id(visible(m.param)): (visible(m.param), m.param) for u in units for m in u.members}
    own = {i: orig for i, (_, orig) in shown.items()}
    for seen, orig in shown.values():  # (stage 3: a frozen weight unfrozen through either object torch
        if seen is not orig and seen.requires_grad != orig.requires_grad:  # code may hold)
            orig.requires_grad_(True)
    groups = [{**{k: v for k, v in g.items() if k != "adamw_mode"},  # (the kernel's key, derived again)
               "params": [own.get(id(p), p) for p in g["params"]]} for g in param_groups]
    new = dict(param_group)
    new["params"] = [new["params"]] if isinstance(new["params"], torch.Tensor) else list(new["params"])
    new["params"] = [own.get(id(p), p) for p in new["params"]]
    taken = {id(p) for g in groups for p in g["params"]}
    twice = [i for i, p in enumerate(new["params"]) if id(p) in taken]
    if twice:
        raise ValueError(f"some parameters appear in more than one parameter group (positions {twice[:5]} "
                         "of the new group are in an existing one)")
    return groups + [new]
