"""Which ZeroOptimizer manages a model: lets model-level helpers (full_state_dict,
load_safetensors, init_meta_weights) find the units without the user passing them."""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Optional

from torch import nn

if TYPE_CHECKING:
    from zeroshard.optim.zero_optimizer import ZeroOptimizer

_BY_MODEL: "weakref.WeakKeyDictionary[nn.Module, ZeroOptimizer]" = weakref.WeakKeyDictionary()


def register(model: nn.Module, optimizer: "ZeroOptimizer") -> None:
    if model in _BY_MODEL:
        raise RuntimeError(f"{type(model).__name__} is already managed by a ZeroOptimizer; one model "
                           "takes one ZeroOptimizer (use param groups for different settings)")
    _BY_MODEL[model] = optimizer


def optimizer_for(model: nn.Module) -> Optional["ZeroOptimizer"]:
    return _BY_MODEL.get(model)
