"""``ModuleGuard``: ``model.to(...)``, ``.cuda()``, ``.float()`` after the optimizer was built.

Note [moving a managed model]: every trainable parameter is a view into its unit's flat buffer
(zeroshard/optim/flat_unit.py). ``nn.Module._apply`` — behind ``.to``, ``.cuda``, ``.half`` —
replaces each parameter's data with ``fn(param)``; even ``.to("cpu:0")`` on a CPU model
(what the Hugging Face Trainer and Accelerate do under torchrun) copies. The copy would
detach the model from the buffers the optimizer updates, so the model would never train (and
at stage 3 the copy would read released storage). The guard wraps ``_apply`` of every module
that holds managed parameters:

- a conversion that leaves a managed parameter's device and dtype as they are (the common
  case: the model is already where it is being sent) skips the managed parameters and their
  gradients and applies to everything else (buffers, parameters zeroshard does not manage);
- a conversion that would move or cast them fails with a message saying to move the model
  before building the optimizer, rather than training a detached copy.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn


class ModuleGuard:
    def __init__(self, model: nn.Module, params: Iterable[torch.Tensor], what: str) -> None:
        self.what = what
        self.managed = {id(p): p for p in params}
        self._modules: list[nn.Module] = []
        for module in model.modules():
            if any(id(p) in self.managed for p in module._parameters.values() if p is not None):
                self._wrap(module)

    def _wrap(self, module: nn.Module) -> None:
        original = module._apply

        def guarded_apply(fn: Callable, *args: Any, **kwargs: Any) -> Any:
            self.check(module, fn)
            skip = set(self.managed)
            skip.update(id(p.grad) for p in self.managed.values() if p.grad is not None)
            return original(lambda t: t if id(t) in skip else fn(t), *args, **kwargs)

        module._apply = guarded_apply
        self._modules.append(module)

    def check(self, module: nn.Module, fn: Callable) -> None:
        for name, p in module._parameters.items():
            if p is None or id(p) not in self.managed:
                continue
            probe = fn(torch.empty(0, dtype=p.dtype, device=p.device))
            if probe.device != p.device or probe.dtype != p.dtype:
                raise RuntimeError(
                    f"{type(module).__name__}.{name} would move from {p.device}/{p.dtype} to "
                    f"{probe.device}/{probe.dtype}, but {self.what} already holds this model's "
                    "parameters in its own buffers there (moving them would train a detached copy). "
                    "Move or cast the model first, then build the optimizer: "
                    "model.to(device); opt = ZeroOptimizer(model, ...)")

    def remove(self) -> None:
        for module in self._modules:
            module.__dict__.pop("_apply", None)  # the class's method shows again
        self._modules.clear()
