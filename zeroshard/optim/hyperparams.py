"""Checking what users pass to a ZeroOptimizer before anything is built: hyperparameters
(as keyword arguments and in param groups), param groups, meta-device parameters.

torch.optim checks some of these itself, but only once the inner optimizer is built, and
with messages that do not name the argument (``'<=' not supported between instances of
'float' and 'str'`` for ``lr="fast"``); a param group without ``params`` is a bare
``KeyError``; a meta parameter at stages 0-2 would silently train zeros. Every refusal here
is one line that names the argument (or group and key) and what to pass instead.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional, Union

import torch
from torch import nn

import inspect

from zeroshard.config import ZeroConfig, check_bool, check_real
from zeroshard.layout import NamedParam
from zeroshard.units.elementwise import update_kind
from zeroshard.optim.kernel_choice import choose_kernels

# Non-negative real hyperparameters of torch.optim's elementwise optimizers.
_NON_NEGATIVE = ("lr", "eps", "weight_decay", "momentum", "dampening", "alpha", "lr_decay",
                 "initial_accumulator_value", "rho", "lambd", "t0", "momentum_decay")
_FLAGS = ("amsgrad", "maximize", "nesterov", "decoupled_weight_decay", "differentiable", "capturable")
_OPTIONAL_FLAGS = ("foreach", "fused")  # None means "let torch choose"


def _scalar(where: str, key: str, value: Any) -> None:
    if isinstance(value, torch.Tensor):  # torch accepts a tensor lr (e.g. for capturable)
        if value.numel() != 1 or not value.is_floating_point():
            raise TypeError(f"{where}{key}={value!r} must be a number or a one-element float tensor")
        value = float(value)
    check_real(f"{where}{key}", value, low=0.0)


def check_hyperparameters(options: Mapping[str, Any], where: str = "") -> None:
    """The common hyperparameters in ``options`` (keyword arguments or one param group) have
    the types and ranges torch.optim expects; ``where`` prefixes the names in messages."""
    for key in _NON_NEGATIVE:
        if key in options:
            _scalar(where, key, options[key])
    if "betas" in options:
        betas = options["betas"]
        ok = isinstance(betas, (tuple, list)) and len(betas) == 2
        if not ok:
            raise TypeError(f"{where}betas={betas!r} must be a pair of numbers in [0, 1), e.g. betas=(0.9, 0.999)")
        if isinstance(betas[0], torch.Tensor) != isinstance(betas[1], torch.Tensor):
            raise ValueError(f"{where}betas={tuple(betas)!r}: betas must be either both floats or both "
                             "Tensors (as torch.optim requires)")
        for i, b in enumerate(betas):
            b = float(b) if isinstance(b, torch.Tensor) and b.numel() == 1 else b
            check_real(f"{where}betas[{i}]", b, low=0.0)
            if not b < 1.0:
                raise ValueError(f"{where}betas={tuple(betas)!r}: each must be in [0, 1), e.g. betas=(0.9, 0.999)")
    for key in _FLAGS:
        if key in options:
            check_bool(f"{where}{key}", options[key])
    for key in _OPTIONAL_FLAGS:
        if key in options and options[key] is not None:
            check_bool(f"{where}{key}", options[key])


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


def separate_optimizer_kwargs(optimizer_class: type[torch.optim.Optimizer], config_kwargs: dict,
                              kwargs: dict, optimizer_kwargs: Optional[dict]) -> dict:
    """The inner optimizer's arguments: ``kwargs`` left after zeroshard's own options were taken
    out, plus ``optimizer_kwargs``, which go to the inner optimizer only. A name that is both a
    zeroshard option and an argument of ``optimizer_class`` is refused in ``**kwargs`` unless
    ``optimizer_kwargs`` was given (then ``**kwargs`` are zeroshard's): guessing would hand one of
    them a value meant for the other."""
    if optimizer_kwargs is None:
        try:
            accepted = set(inspect.signature(optimizer_class.__init__).parameters)
        except (TypeError, ValueError):
            accepted = set()
        both = sorted(set(config_kwargs) & accepted)
        if both:
            raise TypeError(
                f"{both} is both a ZeroOptimizer option and an argument of {optimizer_class.__name__}: pass "
                f"the optimizer's in optimizer_kwargs={{{both[0]!r}: ...}} (then {both} as keywords are "
                "ZeroOptimizer's)")
        return kwargs
    if not isinstance(optimizer_kwargs, dict) or not all(isinstance(k, str) for k in optimizer_kwargs):
        raise TypeError(f"optimizer_kwargs must be a dict of argument names to values, got {optimizer_kwargs!r}")
    twice = sorted(set(kwargs) & set(optimizer_kwargs))
    if twice:
        raise TypeError(f"{twice} given both as keywords and in optimizer_kwargs: give each once")
    if "params" in optimizer_kwargs:
        raise TypeError("optimizer_kwargs names 'params': the parameters are ZeroOptimizer's first argument")
    return {**kwargs, **optimizer_kwargs}


def check_optimizer_kwargs(optimizer_class: type[torch.optim.Optimizer], kwargs: dict) -> None:
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


def single_dtype(trainable: list[NamedParam]) -> torch.dtype:
    dtypes = {m.param.dtype for m in trainable}
    if len(dtypes) > 1:
        raise TypeError(f"trainable parameters mix dtypes {sorted(map(str, dtypes))}; cast the model "
                        "to one dtype, or use mixed_precision='bf16'/'fp16' to let zeroshard do it")
    return dtypes.pop()


def nvme_kernel_refusal(optimizer_class: type, kwargs: dict, groups: Sequence[dict] = (),
                        fused: Sequence[bool] = ()) -> ValueError:
    """Names the first elementwise param group the NVMe stream cannot carry (whole-tensor
    classes stream their own state: Note [generic state on NVMe])."""
    off = [(i, g.get("optimizer_class", optimizer_class)) for i, (g, ok) in enumerate(zip(groups, fused))
           if not ok and update_kind(g.get("optimizer_class", optimizer_class)) == "elementwise"]
    cls = off[0][1] if off else optimizer_class
    where = f"param group {off[0][0]}: " if len(groups) > 1 and off else ""
    options = kwargs if cls is optimizer_class else {}
    return ValueError(
        f"{where}offload_optimizer='nvme' streams elementwise state as Adam/AdamW moments through the fused kernel; "
        f"{getattr(cls, '__name__', cls)}(**{options}) does not run on it (use torch.optim.Adam or AdamW without "
        "amsgrad/foreach/fused/capturable, a whole-tensor class such as Muon or Adafactor, or offload_optimizer='cpu')")


def check_nvme_kernel(config: ZeroConfig, optimizer_class: type, kwargs: dict, group_options: list[dict],
                      params: list[torch.Tensor]) -> None:
    """offload_optimizer="nvme" steps every group on the fused kernel: a class, option or dtype
    it does not run is refused here, before any parameter is moved (Note [refused construction]
    in zeroshard/optim/construction.py). ``group_options``: each group's options, no params."""
    if not config.optimizer_swapped:
        return
    float64 = config.mixed_precision is None and any(p.requires_grad and p.dtype == torch.float64 for p in params)
    options = group_options or [{}]
    fused = choose_kernels(optimizer_class, kwargs, options, config.fused_adam and not float64)
    # (whole-tensor classes stream their own state: Note [generic state on NVMe])
    if not all(f or update_kind(g.get("optimizer_class", optimizer_class)) == "whole" for g, f in zip(options, fused)):
        refusal = nvme_kernel_refusal(optimizer_class, kwargs, options, fused)
        if not config.fused_adam or float64:
            why = "fused_adam=False" if not config.fused_adam else "float64 parameters"
            raise ValueError(f"{refusal} ({why}: the kernel is off)")
        raise refusal
