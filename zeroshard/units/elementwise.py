"""How an optimizer's update reads its parameters: element by element, or whole tensors.

ZeRO updates each rank's slice of a flat buffer, which is exact only for an optimizer whose
update of an element depends on that element's own history plus scalars shared by the group
(lr, step count): those run on the flat slices (``"elementwise"``: torch's SGD, Adam, AdamW,
... and classes that set ``zeroshard_elementwise = True``). Every other optimizer whose update
of a parameter depends only on that parameter's own gradient and state (Muon's
orthogonalisation, Adafactor's factored moments, LAMB-style trust ratios, Shampoo, a user's
class) takes the whole-tensor path (``"whole"``: Note [whole-tensor units] in
zeroshard/layout/bucketing.py): each such parameter has one owner rank that runs the class's
own update on it. Optimizers that couple all parameters (LBFGS re-evaluates the closure over
all of them) or need sparse gradients (SparseAdam) are refused.
"""
from __future__ import annotations

import torch

_ELEMENTWISE = tuple(
    getattr(torch.optim, name) for name in (
        "SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adamax", "NAdam", "RAdam",
        "Adadelta", "ASGD", "Rprop",
    ) if hasattr(torch.optim, name))

_REFUSED = {
    "LBFGS": "couples every parameter through its closure and line search: it is neither elementwise nor per "
             "tensor, so no sharding of its state is exact",
    "SparseAdam": "needs sparse gradients, and ZeRO's gradients live in dense flat buffers",
}


def update_kind(optimizer_class: object) -> str:
    """``"elementwise"`` or ``"whole"``; an error for what is not an optimizer class or
    cannot be sharded exactly."""
    if not isinstance(optimizer_class, type) or not issubclass(optimizer_class, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer_class must be a torch.optim.Optimizer subclass such as torch.optim.AdamW, "
            f"got {optimizer_class!r} (pass the class, not an instance)")
    declared = getattr(optimizer_class, "zeroshard_elementwise", None)
    if declared is not None:
        return "elementwise" if declared else "whole"
    for base in optimizer_class.__mro__:
        if base.__module__.startswith("torch.optim") and base.__name__ in _REFUSED:
            raise ValueError(f"{optimizer_class.__qualname__} {_REFUSED[base.__name__]} (it is not elementwise "
                             "either); use an optimizer whose update of a parameter reads only that parameter's "
                             "gradient and state (AdamW, SGD, Muon, Adafactor, ...)")
    return "elementwise" if issubclass(optimizer_class, _ELEMENTWISE) else "whole"


def check_elementwise(optimizer_class: object) -> None:
    """Refuses what cannot be sharded exactly (``update_kind``)."""
    update_kind(optimizer_class)
