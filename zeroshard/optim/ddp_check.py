"""DistributedDataParallel around a model a ZeroOptimizer manages: refused, with the fix.

A ZeroOptimizer reduces the gradients itself (its hooks take each gradient into a bucket and
clear ``.grad``). DDP's reducer, kept around the same parameters (what every DDP script has,
e.g. nanoGPT's ``model = DDP(model)``), then finds no gradient to reduce and, at the end of
backward, writes its buckets over the ones zeroshard published: the model trains on zeros
without a word. So DDP is looked for where it can be seen:

- at construction: the model (or ``module=``) is a DDP;
- at each forward (a pre-hook of the module guard): a DDP's forward is running over the
  managed module (``DistributedDataParallel._active_ddp_module``, which DDP sets around its
  module's forward), whether the DDP was built before or after the optimizer;
- at the first backward, for an optimizer given parameters without their module: a live DDP
  over them (found once among the live objects, only when torch.distributed is initialized:
  DDP needs a process group).
"""
from __future__ import annotations

import gc
import weakref
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn

FIX = ("pass model.module / do not wrap the model in DistributedDataParallel: ZeroOptimizer does the "
       "data-parallel reduction itself (a DDP kept around it leaves every gradient zero). Build it as "
       "ZeroOptimizer(model, ...) over the unwrapped model and call model(x) directly")


def _ddp_class() -> Optional[type]:
    if not dist.is_available():
        return None
    from torch.nn.parallel import DistributedDataParallel
    return DistributedDataParallel


def refuse_wrapper(obj: Any, what: str) -> None:
    """``obj`` (the model, or ``module=``) must not be a DDP."""
    ddp = _ddp_class()
    if ddp is not None and isinstance(obj, ddp):
        raise RuntimeError(f"{what} is a DistributedDataParallel: {FIX}")


def _reduces(ddp: Any, ids: set[int]) -> bool:
    params = getattr(ddp, "_module_parameters", None)
    if params is None:
        module = getattr(ddp, "module", None)
        params = list(module.parameters()) if isinstance(module, nn.Module) else []
    return any(id(p) in ids for p in params)


def live_ddp_over(params: Iterable[torch.Tensor]) -> Optional[Any]:
    """A live DDP whose reducer holds one of ``params`` (a walk over the live objects: call it
    once, not per step). None without torch.distributed initialized."""
    ddp = _ddp_class()
    if ddp is None or not dist.is_initialized():
        return None
    ids = {id(p) for p in params}

    def find() -> Optional[Any]:
        objects = gc.get_objects()
        kinds = [t for t in set(map(type, objects)) if issubclass(t, ddp)]  # (C loops: no DDP, no Python loop)
        if not kinds:
            return None
        return next((o for o in objects if type(o) in kinds and _reduces(o, ids)), None)
    if find() is None:
        return None
    gc.collect()  # (a DDP the user dropped may still sit in a reference cycle)
    return find()


def refuse_live_ddp(params: Iterable[torch.Tensor], when: str) -> None:
    found = live_ddp_over(params)
    if found is not None:
        raise RuntimeError(f"a DistributedDataParallel ({type(found.module).__name__}) reduces the gradients of "
                           f"parameters this ZeroOptimizer manages ({when}): {FIX}")


def refuse_active_ddp(managed: dict[int, torch.Tensor], checked: "weakref.WeakSet") -> None:
    """From a forward pre-hook: the DDP whose forward runs now, if it reduces managed parameters.
    ``checked``: DDPs already seen to be over other parameters (a nested model of its own)."""
    ddp = _ddp_class()
    active = getattr(ddp, "_active_ddp_module", None) if ddp is not None else None
    if active is None or active in checked:
        return
    if _reduces(active, set(managed)):
        raise RuntimeError(f"this model runs inside DistributedDataParallel(...) while a ZeroOptimizer manages "
                           f"it: {FIX}")
    checked.add(active)


def at_first_backward(params: Iterable[torch.Tensor]) -> Any:
    """A pass-start callback for an optimizer given parameters without their module: looks for a
    DDP over them once, at the first backward (a DDP wrapped after the optimizer was built)."""
    refs = [weakref.ref(p) for p in params]
    done = [False]

    def check() -> None:
        if not done[0]:
            done[0] = True
            refuse_live_ddp([p for p in (r() for r in refs) if p is not None], "a DDP wrapped after it was built")
    return check
