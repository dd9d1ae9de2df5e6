"""Which optimizers can run on flat pieces of parameters.

ZeRO updates each rank's slice of a flat buffer, so an optimizer is exact under sharding
only when its update of an element depends on that element's own history plus scalars
shared by the whole group (lr, step count). Optimizers that look at whole tensors
(Adafactor's factored moments, LAMB/LARS trust ratios, Shampoo, Muon) or at all
parameters at once (LBFGS) would silently compute something else, so they are refused.
A custom elementwise optimizer opts in with ``zeroshard_elementwise = True``.
"""
from __future__ import annotations

import torch

_ELEMENTWISE = tuple(
    getattr(torch.optim, name) for name in (
        "SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adamax", "NAdam", "RAdam",
        "Adadelta", "ASGD", "Rprop",
    ) if hasattr(torch.optim, name))


def check_elementwise(optimizer_class: type) -> None:
    if not isinstance(optimizer_class, type) or not issubclass(optimizer_class, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer_class must be a torch.optim.Optimizer subclass such as torch.optim.AdamW, "
            f"got {optimizer_class!r} (pass the class, not an instance)")
    if getattr(optimizer_class, "zeroshard_elementwise", False):
        return
    if issubclass(optimizer_class, _ELEMENTWISE):
        return
    names = ", ".join(c.__name__ for c in _ELEMENTWISE)
    raise ValueError(
        f"{optimizer_class.__module__}.{optimizer_class.__qualname__} is not known to be "
        f"elementwise, so it cannot run on the flat slices ZeRO gives each rank (optimizers "
        f"that use whole tensors or all parameters - Adafactor, LAMB, Shampoo, Muon, LBFGS - "
        f"would compute something different). Supported: {names}. If your optimizer updates "
        f"each element from its own state only, set `zeroshard_elementwise = True` on its class.")
