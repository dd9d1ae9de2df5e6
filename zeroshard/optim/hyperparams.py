"""Checking what users pass to a ZeroOptimizer before anything is built: hyperparameters
(as keyword arguments and in param groups), param groups, meta-device parameters.

torch.optim checks some of these itself, but only once the inner optimizer is built, and
with messages that do not name the argument (``'<=' not supported between instances of
'float' and 'str'`` for ``lr="fast"``); a param group without ``params`` is a bare
``KeyError``; a meta parameter at stages 0-2 would silently train zeros. Every refusal here
is one line that names the argument (or group and key) and what to pass instead.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Union

import torch
from torch import nn

from zeroshard.config import check_bool, check_real

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


def _meta_refusal(names: list[str], stage: int) -> ValueError:
    shown = ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return ValueError(
        f"parameter(s) {shown} are on the meta device (no values) at stage={stage}: stages 0-2 would train "
        "zeros. Materialise them first (model.to_empty(device=...) and load weights), or use stage=3 with "
        "the module itself and zeroshard.load_safetensors / zeroshard.init_meta_weights")


def check_inputs(model_or_params: Any, stage: int, kwargs: Mapping[str, Any]) -> Union[nn.Module, list]:
    """Checks the parameters and hyperparameters of a ZeroOptimizer; returns the module, or
    the parameters as a list (a generator can be read once only)."""
    check_hyperparameters(kwargs)
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
    items = list(model_or_params)
    meta: list[str] = []
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
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        items[gi] = {**item, "params": params}  # a generator in a group is read here, once
        for k, entry in enumerate(params):
            p = entry[1] if isinstance(entry, tuple) and len(entry) == 2 else entry
            if isinstance(p, torch.Tensor) and p.is_meta:
                meta.append(str(entry[0]) if p is not entry else f"param group {gi} [{k}]")
            real += isinstance(p, torch.Tensor) and not p.is_meta
    if meta and not real:
        raise _meta_refusal(meta, stage)
    return items
