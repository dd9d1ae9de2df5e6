"""Checking the hyperparameters users pass to a ZeroOptimizer (as keyword arguments and in param
groups) before anything is built; the DeepSpeed config's optimizer parameters go through it too.

torch.optim checks some of these itself, but only once the inner optimizer is built, and
with messages that do not name the argument (``'<=' not supported between instances of
'float' and 'str'`` for ``lr="fast"``). Every refusal here is one line that names the argument
(or group and key) and what to pass instead.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

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
