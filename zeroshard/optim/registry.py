"""Which ZeroOptimizer manages a model: lets model-level helpers (full_state_dict,
load_safetensors, init_meta_weights) find the units without the user passing them.

The entry holds the optimizer weakly (it references the model, so a strong value would keep
the key alive forever): once the optimizer is closed or collected the model is free again."""
from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Optional

from torch import nn

if TYPE_CHECKING:
    from zeroshard.optim.zero_engine import EngineOwner

_BY_MODEL: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()


def register(model: nn.Module, optimizer: "EngineOwner") -> None:
    current = optimizer_for(model)
    if current is not None and current is not optimizer:
        raise RuntimeError(f"{type(model).__name__} is already managed by a live ZeroOptimizer ({current!r}); "
                           "one model takes one ZeroOptimizer (use param groups for different settings, "
                           "or close() the first one)")
    _BY_MODEL[model] = weakref.ref(optimizer)


def unregister(model: nn.Module) -> None:
    """Forgets the model's optimizer if it is closed or gone (never a live successor's entry)."""
    if model in _BY_MODEL and optimizer_for(model) is None:
        del _BY_MODEL[model]


def optimizer_for(model: nn.Module) -> Optional["EngineOwner"]:
    """The live optimizer of ``model``, or of the module a ``torch.compile`` wrapper holds
    (``_orig_mod``: the wrapper's state dict has the same tensors under ``_orig_mod.`` keys, so
    ``full_state_dict(torch.compile(model))`` gathers them like the model's own)."""
    while True:
        ref = _BY_MODEL.get(model)
        opt = ref() if ref is not None else None
        if opt is not None and not getattr(opt, "closed", False):
            return opt
        inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return None
        model = inner
