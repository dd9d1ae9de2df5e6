"""The inner optimizer over this rank's runs, seen as one object: ``GroupedInner`` joins a
FusedAdam and the user's class when param groups need both (kernel_choice.py chooses), and
the helpers that step or normalise whichever inner optimizer there is."""
from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch


class GroupedInner:
    """Several inner optimizers presented as one: ``param_groups`` in the user's group order
    (the parts' own dicts, so writes reach them), one shared ``state``, one ``step``."""

    def __init__(self, parts: list[tuple[torch.optim.Optimizer, list[int]]], n_groups: int,
                 defaults: dict) -> None:
        self.parts = parts
        self.param_groups: list[dict] = [{}] * n_groups
        for opt, indices in parts:
            for g, i in zip(opt.param_groups, indices):
                self.param_groups[i] = g
        self.defaults = defaults
        self.state = defaultdict(dict)

    @property
    def state(self) -> Any:
        return self._state

    @state.setter
    def state(self, value: Any) -> None:
        self._state = value
        for opt, _ in self.parts:
            opt.state = value

    def step(self, **kwargs: Any) -> None:
        for opt, _ in self.parts:
            step_without_hooks(opt, **(kwargs if isinstance(opt, torch.optim.Optimizer) and
                                       type(opt).__name__ != "FusedAdam" else {}))

    def state_dict(self) -> dict:  # for completeness (debugging); zeroshard never pickles it
        return {"parts": [opt.state_dict() for opt, _ in self.parts]}


def step_without_hooks(inner: Any, **kwargs: Any) -> Any:
    """The inner optimizer's step without torch's step hooks: global hooks
    (``register_optimizer_step_pre_hook``) and profiling belong to the user's optimizer,
    the ZeroOptimizer, whose step already ran them; the inner one would run them again."""
    if isinstance(inner, GroupedInner):
        return inner.step(**kwargs)
    fn = type(inner).step
    fn = getattr(fn, "__wrapped__", fn) if getattr(fn, "hooked", False) else fn
    return fn(inner, **kwargs)


def normalize_state(inner: Any) -> None:
    """After a load, the normalisation torch.optim applies in ``load_state_dict`` (each
    optimizer's ``__setstate__``: a plain-number ``step`` of an older state dict becomes a
    tensor, missing group defaults are filled in)."""
    for opt in (p for p, _ in inner.parts) if isinstance(inner, GroupedInner) else (inner,):
        if isinstance(opt.state, dict):
            type(opt).__setstate__(opt, {"state": opt.state, "param_groups": opt.param_groups})
