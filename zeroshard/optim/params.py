"""The parameters users pass to a ZeroOptimizer: checked before anything is built (param groups
without ``params``, sets, meta-device parameters at stages 0-2, which would train zeros),
normalised into named param groups, the trainable ones listed (leaf, dense, floating point,
one device, one group each), and the groups a rebuild for ``add_param_group`` starts from."""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
from torch import nn

from zeroshard.layout import NamedParam, real_dtype
from zeroshard.optim.hyperparams import check_hyperparameters

if TYPE_CHECKING:
    from zeroshard.units.flat_unit import FlatUnit

ParamsLike = Union[nn.Module, Iterable[torch.Tensor], Iterable[tuple[str, torch.Tensor]], Iterable[dict]]


# torch.optim's refusal: parameter order decides checkpoint keys and layout, and a set's
# iteration order changes between runs.
_SET_REFUSAL = ("optimizer parameters need to be organized in ordered collections, but the ordering "
                "of tensors in sets will change between runs; use a list instead")


def _meta_refusal(names: list[str], stage: int) -> ValueError:
    shown = ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return ValueError(
        f"parameter(s) {shown} are on the meta device (no values) at stage={stage}: stages 0-2 would train "
        "zeros. Materialise them first (model.to_empty(device=...) and load weights), or use stage=3 with "
        "the module itself and zeroshard.load_safetensors / zeroshard.init_meta_weights")


def check_inputs(model_or_params: Any, stage: int, kwargs: Mapping[str, Any],
                 module: Optional[nn.Module] = None) -> Union[nn.Module, list]:
    """Checks the parameters and hyperparameters of a ZeroOptimizer; returns the module, or
    the parameters as a list (a generator can be read once only)."""
    check_hyperparameters(kwargs)
    if stage == 3 and not isinstance(model_or_params, nn.Module) and module is None:
        raise ValueError("stage=3 partitions parameters by module, so it needs the nn.Module: "
                         "ZeroOptimizer(model, ...), or with param groups "
                         "ZeroOptimizer(groups, ..., stage=3, module=model)")
    if isinstance(model_or_params, nn.Module):
        if stage != 3:
            meta = [n for n, p in model_or_params.named_parameters() if p.is_meta]
            if meta:
                raise _meta_refusal(meta, stage)
        return model_or_params
    if isinstance(model_or_params, (torch.Tensor, str, bytes, Mapping)) or not isinstance(model_or_params, Iterable):
        what = "a single Tensor; wrap it in a list" if isinstance(model_or_params, torch.Tensor) else \
            f"a value of type {type(model_or_params).__name__}"
        raise TypeError(f"model_or_params must be an nn.Module, an iterable of parameters, of (name, parameter) "
                        f"pairs or of param groups (dicts with 'params'); got {what}")
    if isinstance(model_or_params, (set, frozenset)):
        raise TypeError(_SET_REFUSAL)
    items = list(model_or_params)
    meta = []  # (list[str], as above)
    real = 0  # parameters with values (a mix with meta ones is refused later as "different devices")
    for gi, item in enumerate(items):
        if not isinstance(item, Mapping):
            p = item[1] if isinstance(item, tuple) and len(item) == 2 else item
            if isinstance(p, torch.Tensor) and p.is_meta:
                meta.append(str(item[0]) if p is not item else f"param.{gi}")
            real += isinstance(p, torch.Tensor) and not p.is_meta
            continue
        if "params" not in item:
            raise ValueError(f"param group {gi} has no 'params' key (it has {sorted(map(str, item))}); give "
                             "each group as {'params': [tensors], <hyperparameters>...}")
        check_hyperparameters(item, where=f"param group {gi}: ")
        params = item["params"]
        if isinstance(params, (str, bytes, Mapping)) or not (isinstance(params, torch.Tensor)
                                                              or isinstance(params, Iterable)):
            raise TypeError(f"param group {gi}: 'params' is a {type(params).__name__}; give a list of tensors")
        if isinstance(params, (set, frozenset)):
            raise TypeError(f"param group {gi}: {_SET_REFUSAL}")
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        items[gi] = {**item, "params": params}  # a generator in a group is read here, once
        for k, entry in enumerate(params):
            p = entry[1] if isinstance(entry, tuple) and len(entry) == 2 else entry
            if isinstance(p, torch.Tensor) and p.is_meta:
                meta.append(str(entry[0]) if p is not entry else f"param group {gi} [{k}]")
            real += isinstance(p, torch.Tensor) and not p.is_meta
    if meta and not real and not (stage == 3 and module is not None):  # (stage 3 builds a meta module's groups too)
        raise _meta_refusal(meta, stage)
    return items


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


def trainable_params(groups: list[dict], names: dict[int, str], shapes: dict[int, torch.Size],
                     skip_empty: bool = False) -> list[NamedParam]:
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
            if p.is_sparse or p.layout != torch.strided:
                raise TypeError(f"parameter {names[id(p)]!r} has layout {p.layout}; ZeroOptimizer lays "
                                "parameters out in flat dense buffers, so sparse parameters are not supported")
            # Stage 3: a parameter with no elements has nothing to shard or update; it stays an
            # ordinary (empty) tensor outside the units.
            if skip_empty and p.requires_grad and shapes.get(id(p), p.shape).numel() == 0:
                continue
            if p.requires_grad:
                if not (p.is_floating_point() or p.is_complex()):  # (complex: Note [complex parameters])
                    raise TypeError(f"parameter {names[id(p)]!r} has dtype {p.dtype}; only floating "
                                    "point and complex parameters can be trained")
                out.append(NamedParam(names[id(p)], p, gi, shapes.get(id(p))))
    if len(devices) > 1:
        where = ", ".join(f"{d} (e.g. {n!r})" for d, n in devices.items())
        raise ValueError(f"parameters are on different devices: {where}; a ZeroOptimizer needs all "
                         "of its parameters on one device (move the model with .to(device) first)")
    if not out:
        raise ValueError("no parameter requires grad; nothing to optimize")
    return out


def single_dtype(trainable: list[NamedParam]) -> torch.dtype:
    """The one (real) dtype of the flat buffers: complex64 parameters sit beside float32 ones
    (Note [complex parameters] in zeroshard/layout/unit_layout.py)."""
    dtypes = {real_dtype(m.param.dtype) for m in trainable}
    if len(dtypes) > 1:
        raise TypeError(f"trainable parameters mix dtypes {sorted(map(str, dtypes))}; cast the model "
                        "to one dtype, or use mixed_precision='bf16'/'fp16' to let zeroshard do it")
    return dtypes.pop()


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
