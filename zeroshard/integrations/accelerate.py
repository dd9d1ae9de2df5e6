"""Hugging Face Accelerate with a ZeroOptimizer: one line before ``prepare``.

    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=..., stage=2)
    accelerator = Accelerator()
    zeroshard.integrations.accelerate.attach(accelerator, opt)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    ...  # accelerator.backward, accelerator.clip_grad_norm_, save_state / load_state as usual

What ``attach`` does, through Accelerate's public hooks:

- keeps the model out of the ``DistributedDataParallel`` wrap ``prepare`` applies at more than
  one process (``_common.keep_out_of_ddp``: the optimizer reduces gradients already), and
  refuses ``Accelerator(mixed_precision=...)``, whose autocast a model kept out of ``prepare``
  would not get (use ``ZeroOptimizer(mixed_precision=...)``);
- ``register_save_state_pre_hook``: every rank arms the save guard (Note [rank-0 saves] in
  ``_common.py``), so the ``optimizer.bin`` Accelerate writes from rank 0 holds every rank's state
  (consolidated, ``torch.optim`` format), and at stage 3 replaces the pieces in the model's
  state dict by full weights (rank 0 writes them). ``load_state`` then needs nothing: each rank
  loads the full weights and cuts its shard from the consolidated optimizer state. The guard is
  disarmed by the next ``optimizer.step()`` (a step pre-hook);
- ``register_load_state_pre_hook``: stage 3 loads the model file itself (safetensors'
  ``load_model``, which Accelerate uses, inspects storages that sharded parameters do not
  have) and puts a stand-in that accepts the file in that model's place in Accelerate's list.
"""
from __future__ import annotations

import os
import weakref
from typing import Any

import torch
from torch import nn

from zeroshard.integrations._common import SaveGuard, _unwrap, check_no_autocast, keep_out_of_ddp, optimizer_of

FIX = ("Attach the zeroshard hooks before prepare, which make save_state write every rank's state: "
       "zeroshard.integrations.accelerate.attach(accelerator, optimizer); or save with "
       "zeroshard.save_checkpoint(dir, step, model=model, optimizer=opt) on every rank")

_ATTACHED: "weakref.WeakKeyDictionary[SaveGuard, object]" = weakref.WeakKeyDictionary()
"""The accelerator each optimizer's save guard was attached to (``attach`` twice adds nothing)."""


def attach(accelerator: Any, optimizer: Any) -> SaveGuard:
    """Prepares ``accelerator`` to train the model of the ZeroOptimizer ``optimizer``; call it
    before ``accelerator.prepare(...)``, on every rank. Returns the save guard."""
    opt = optimizer_of(None, optimizer)
    if opt.engine.module is None:
        raise ValueError("attach needs a ZeroOptimizer built from the model (ZeroOptimizer(model, ...)), not from "
                         "a list of parameters: Accelerate saves and loads the model")
    check_no_autocast(accelerator.mixed_precision, "Accelerator(mixed_precision=...):")
    keep_out_of_ddp(opt.engine.module)
    guard = SaveGuard.install(opt, FIX)
    if _ATTACHED.get(guard) is accelerator:
        return guard
    _ATTACHED[guard] = accelerator
    opt.register_step_pre_hook(lambda *_: guard.disarm())
    module = opt.engine.module

    def before_save(models: list, weights: list, output_dir: str) -> None:
        guard.disarm()
        guard.arm(optimizer=True, weights=False)
        if not opt.engine.shards_parameters:
            return
        from zeroshard import full_state_dict
        for model, sd in zip(models, weights):
            if _unwrap(model) is module:
                full = full_state_dict(module, rank0_only=True)
                # Rank 0 writes: full weights, in the same dict (Accelerate dedups tied entries of
                # an OrderedDict). The others write nothing but still run safetensors' storage
                # checks on their dict, which pieces (no storage) fail: empty stand-ins there.
                for key in list(sd):
                    sd[key] = full[key] if full is not None else torch.empty(0)

    def before_load(models: list, input_dir: str) -> None:
        if not opt.engine.shards_parameters:
            return
        for i, model in enumerate(models):
            if _unwrap(model) is module:
                _load_stage3_weights(module, input_dir, i)
                models[i] = _AlreadyLoaded()  # (same index: Accelerate names files by position)

    accelerator.register_save_state_pre_hook(before_save)
    accelerator.register_load_state_pre_hook(before_load)
    return guard


class _AlreadyLoaded(nn.Module):
    """Takes a model's place in ``load_state``'s list once the hook loaded it: accepts any state."""

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        from torch.nn.modules.module import _IncompatibleKeys
        return _IncompatibleKeys([], [])


def _load_stage3_weights(model: nn.Module, input_dir: str, index: int) -> None:
    """Loads Accelerate's model file into a stage-3 model (a full state dict: each rank keeps its
    pieces)."""
    import safetensors.torch as st
    suffix = "" if index == 0 else f"_{index}"
    safe = os.path.join(input_dir, f"model{suffix}.safetensors")
    plain = os.path.join(input_dir, f"pytorch_model{suffix}.bin")
    if os.path.isfile(safe):
        state = st.load_file(safe)
    elif os.path.isfile(plain):
        state = torch.load(plain, map_location="cpu", weights_only=True)
    else:
        raise FileNotFoundError(f"no model file for model {index} in {input_dir!r} (looked for {safe!r}, {plain!r})")
    result = model.load_state_dict(state, strict=False)
    expected = set(model.state_dict(keep_vars=True))
    missing = [k for k in result.missing_keys if not _tied_to_loaded(model, k, state)]
    if missing or result.unexpected_keys:
        raise ValueError(f"{safe}: does not match the model (missing {missing[:5]}, unexpected "
                         f"{result.unexpected_keys[:5]} of {len(expected)} keys)")


def _tied_to_loaded(model: nn.Module, key: str, state: dict) -> bool:
    """A key dropped by the saver as a duplicate of a tied parameter that was loaded."""
    live = model.state_dict(keep_vars=True)
    return any(live[key] is live[k] for k in state if k in live)


__all__ = ["attach", "FIX"]
