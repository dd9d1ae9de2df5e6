"""``ModuleGuard``: ``model.to(...)``, ``.cuda()``, ``.float()`` after the optimizer was built.

Note [moving a managed model]: every trainable parameter is a view into its unit's flat buffer
(zeroshard/units/flat_unit.py). ``nn.Module._apply`` — behind ``.to``, ``.cuda``, ``.half`` —
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

Note [state dicts of flat parameters]: at stages 0-2 every parameter is a view of one flat
buffer, so ``model.state_dict()`` would hand out tensors that all share one storage.
safetensors-based savers (Accelerate's ``save_state``, ``save_model``) then keep one tensor of
the group, or refuse. The guard's state-dict hook gives each such entry its own storage (a
copy, the size of the model's weights, for the duration of the caller's use); with
``keep_vars=True`` (the Parameters themselves) nothing is copied. Stage 3 shows sharded
parameters instead (Note [sharded parameters] in zeroshard/stages/stage3/gatherer.py).

The guard's forward pre-hook (run first) refuses a forward that DistributedDataParallel runs
over the managed model: DDP kept around it would leave every gradient zero
(zeroshard/optim/ddp_check.py).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable

import torch
from torch import nn

from zeroshard.optim import ddp_check


class ModuleGuard:
    def __init__(self, model: nn.Module, params: Iterable[torch.Tensor], what: str,
                 flat_buffers: Iterable[torch.Tensor] = ()) -> None:
        self.what = what
        self.managed = {id(p): p for p in params}
        self._modules: list[nn.Module] = []
        for module in model.modules():
            if any(id(p) in self.managed for p in module._parameters.values() if p is not None):
                self._wrap(module)
        self._flat = {b.untyped_storage().data_ptr() for b in flat_buffers if b.untyped_storage().nbytes()}
        # (a function, not a bound method: torch marks public hooks with an attribute)
        self._hooks = ([model.register_state_dict_post_hook(lambda *a: self._own_storage(*a))]
                       if self._flat else [])
        # DDP kept around the model (zeroshard/optim/ddp_check.py); first, before any gather
        self._ddp_seen: weakref.WeakSet = weakref.WeakSet()
        self._hooks.append(model.register_forward_pre_hook(
            lambda *a: ddp_check.refuse_active_ddp(self.managed, self._ddp_seen), prepend=True))

    def _own_storage(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
        for key, t in state_dict.items():  # Note [state dicts of flat parameters]
            if (type(t) is torch.Tensor and t.untyped_storage().nbytes()
                    and t.untyped_storage().data_ptr() in self._flat):
                state_dict[key] = t.clone()

    def _wrap(self, module: nn.Module) -> None:
        original = module._apply

        def guarded_apply(fn: Callable, *args: Any, **kwargs: Any) -> Any:
            self.check(module, fn)
            skip = set(self.managed)
            skip.update(id(p.grad) for p in self.managed.values() if p.grad is not None)
            return original(lambda t: t if id(t) in skip else fn(t), *args, **kwargs)

        # per-instance wrap of torch's Module._apply; remove() pops it from the instance dict
        module._apply = guarded_apply  # type: ignore[method-assign]
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
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for module in self._modules:
            module.__dict__.pop("_apply", None)  # the class's method shows again
        self._modules.clear()
