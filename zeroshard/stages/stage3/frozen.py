"""Frozen parameters at stage 3: partitioned and gathered like trainable ones, never trained.

Note [frozen units]: parameter-efficient fine-tuning (LoRA) freezes ~99% of a model, so a
stage 3 that shards only trainable parameters saves nothing where it matters. Frozen
parameters (``requires_grad=False``) are therefore laid out in units of their own beside the
trainable units of the same module: a transformer block with LoRA adapters gets a trainable
unit (the adapters) and a frozen unit (its base weights), both gathered by the block's hooks
and released after it. A frozen unit is a ``FlatUnit`` with ``frozen=True``: a shard and the
gathered buffer in the parameters' own dtype (a bf16 base stays 2 bytes per parameter; one
frozen unit per dtype), no fp32 master, no gradient store, no optimizer runs, and nothing in
the gradient reducer. ``offload_params`` places its shard like a trainable one ("cpu": host
memory; "nvme": the swap file, read just before each gather).

Frozen units live in ``ZeroOptimizer.frozen_units``, not ``units``: everything that trains
(reduction, clipping, the step, optimizer state, checkpoint pieces of what trains) walks
``units`` and so never sees them; what deals in weights (gathering, ``segment_index``,
``full_state_dict``, ``load_safetensors``, ``init_meta_weights``, closing) walks both
(``ZeroOptimizer.all_units``).

Releasing in backward: a trainable unit is released once its gradients are reduced. A frozen
unit has no gradients to tell when backward is done with it, so it is released when backward
reaches a unit that came *earlier* in forward (the gradient of the earlier module's output is
complete only after every node of the later modules on the path to it has run, and only those
nodes read the later module's weights), and at the end of backward at the latest.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import nn

from zeroshard.layout import NamedParam


def frozen_params(module: nn.Module, shapes: dict[int, torch.Size], trained: frozenset[int]) -> list[NamedParam]:
    """The module's floating-point parameters with elements that are not ``trained`` (ids of the
    param groups' parameters that require grad), once each (tied ones once): frozen ones, and
    trainable ones the param groups leave out (not trained, as with torch.optim)."""
    out: list[NamedParam] = []
    for name, p in module.named_parameters():
        if id(p) in trained or not p.is_floating_point():
            continue
        if shapes.get(id(p), p.shape).numel() == 0:
            continue
        out.append(NamedParam(name, p, 0, shapes.get(id(p))))
    return out


def split_frozen(groups: Sequence[Sequence[NamedParam]], modules: Sequence[Optional[nn.Module]],
                 trained: frozenset[int], dtype_of: Callable[[NamedParam], torch.dtype] = lambda m: m.param.dtype
                 ) -> tuple[list[list[NamedParam]], list[Optional[nn.Module]],
                            list[list[NamedParam]], list[Optional[nn.Module]]]:
    """Splits planned units (each mixing trainable and frozen parameters of one module) into
    trainable units (members whose ids are in ``trained``) and frozen units (one per dtype: ``dtype_of``, the dtype a frozen weight will
    have, e.g. cast by mixed precision), keeping each unit's module."""
    trainable, t_modules, frozen, f_modules = [], [], [], []
    for group, module in zip(groups, modules):
        train = [m for m in group if id(m.param) in trained]
        if train:
            trainable.append(train)
            t_modules.append(module)
        by_dtype: dict[torch.dtype, list[NamedParam]] = {}
        for m in group:
            if id(m.param) not in trained:
                by_dtype.setdefault(dtype_of(m), []).append(m)
        for members in by_dtype.values():
            frozen.append(members)
            f_modules.append(module)
    return trainable, t_modules, frozen, f_modules
