"""Which keyword arguments of a ZeroOptimizer go to the inner optimizer: zeroshard's own options
taken out, ``optimizer_kwargs`` added, and what is left checked against the class's signature
(a misspelt option is refused naming both sets of names, not passed on or dropped).
"""
from __future__ import annotations

import inspect
from typing import Optional

import torch

from zeroshard.config import ZeroConfig


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
