"""``zeroshard.initialize``: a model, a ZeroOptimizer and a schedule from a DeepSpeed config.

    model, optimizer, scheduler = zeroshard.initialize(model, config="ds_config.json")

Unlike ``deepspeed.initialize`` there is no engine: the model is returned unchanged, the
optimizer is a ``torch.optim.Optimizer`` and the loop stays yours. The settings DeepSpeed's
engine would apply inside ``engine.step()`` (gradient clipping, accumulation, micro-batch
size) are on the result's ``.plan`` for your loop to use.
"""
from __future__ import annotations

import os
from typing import Any, Iterable, Mapping, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from zeroshard.optim.muon_recipe import recipe_groups
from zeroshard.optim.params import ParamsLike
from zeroshard.optim.zero_optimizer import ZeroOptimizer
from zeroshard.train.deepspeed_config import DeepSpeedPlan, translate
from zeroshard.train.deepspeed_zeropp import hpz_mesh
from zeroshard.train.schedules import build_schedule


class Initialized(tuple):
    """``(model, optimizer, scheduler)``, unpackable like a tuple, plus ``.plan``."""

    plan: DeepSpeedPlan

    def __new__(cls, model: nn.Module, optimizer: ZeroOptimizer, scheduler: Any, plan: DeepSpeedPlan) -> "Initialized":
        obj = super().__new__(cls, (model, optimizer, scheduler))
        obj.plan = plan
        return obj

    @property
    def model(self) -> nn.Module:
        return self[0]

    @property
    def optimizer(self) -> ZeroOptimizer:
        return self[1]

    @property
    def scheduler(self) -> Any:
        return self[2]


def _world_size(process_group: Optional[dist.ProcessGroup]) -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(process_group)
    return 1


def _flat_params(given: list) -> list[torch.Tensor]:
    """The tensors of ``model_parameters``: tensors, ``(name, tensor)`` pairs or group dicts."""
    out: list[torch.Tensor] = []
    for item in given:
        if isinstance(item, dict):
            inner = item.get("params", [])
            out.extend(_flat_params([inner] if isinstance(inner, torch.Tensor) else list(inner)))
        elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor):
            out.append(item[1])
        elif isinstance(item, torch.Tensor):
            out.append(item)
    return out


def check_model_parameters(model: nn.Module, given: list) -> None:
    """Refuses ``model_parameters`` holding tensors that are not the model's: the optimizer
    would step tensors no forward reads, and the model would silently never train."""
    own = {id(p) for p in model.parameters()}
    foreign = [p for p in _flat_params(given) if id(p) not in own]
    if foreign:
        shapes = [tuple(p.shape) for p in foreign[:4]]
        raise ValueError(f"initialize(model_parameters=...): {len(foreign)} tensor(s) are not parameters of the "
                         f"{type(model).__name__} passed as model= (shapes {shapes}{' ...' if len(foreign) > 4 else ''})"
                         "; training would not change the model. Pass model_parameters=model.parameters() (or "
                         "param groups of the model's own parameters)")


def build_optimizer(model: nn.Module, model_parameters: Optional[Iterable], plan: DeepSpeedPlan,
                    process_group: Optional[dist.ProcessGroup] = None) -> ZeroOptimizer:
    """The ZeroOptimizer a config's plan describes, for ``zeroshard.initialize`` and
    ``deepspeed.initialize`` alike (one path, so Muon's recipe and the checks hold in both)."""
    if plan.optimizer_class is None:
        raise ValueError("the config has no 'optimizer' section; add one (e.g. {\"type\": \"AdamW\", \"params\": "
                         "{\"lr\": 1e-4}})")
    given = None if model_parameters is None else list(model_parameters)
    if given is not None:
        if not given:
            raise ValueError("initialize(model_parameters=...) is empty; pass model.parameters() or param groups")
        check_model_parameters(model, given)
    params: ParamsLike = model if given is None else given
    cls, kwargs = plan.optimizer_class, plan.optimizer_kwargs
    if cls is torch.optim.Muon:  # Muon's recipe (Note [Muon from a config] in zeroshard/optim/muon_recipe.py)
        params, cls, kwargs = recipe_groups(model, given, kwargs)
    # module=: stage 3 plans its units by module, also when param groups are given.
    mesh = hpz_mesh(plan.hpz_partition_size, process_group)
    return ZeroOptimizer(params, cls, process_group=process_group, mesh=mesh,
                         module=model if params is not model else None, **plan.zero, **kwargs)


def initialize(model: nn.Module, config: Union[None, str, os.PathLike, Mapping] = None, *,
               model_parameters: Any = None, process_group: Optional[dist.ProcessGroup] = None,
               strict: bool = True, auto: Optional[Mapping[str, Any]] = None, **overrides: Any) -> Initialized:
    """Builds a ZeroOptimizer (and a schedule, if the config has one) for ``model``.

    ``config``: a DeepSpeed JSON file or dict (the common subset: zero_optimization, optimizer,
    scheduler, fp16/bf16, gradient_clipping, batch sizes; see ``deepspeed_config.py``). Keys it
    does not support raise a ValueError naming each (``strict=False``: a warning).
    ``model_parameters``: param groups (default: the model); at stage 3 too.
    ``overrides``: zeroshard names that win over the config and resolve its "auto" values:
    ``stage, offload_optimizer, offload_params, nvme_path, mixed_precision, bucket_size_mb,
    reduce_dtype, optimizer`` (a class), ``lr, weight_decay, betas, eps, momentum,
    gradient_clipping, gradient_accumulation_steps, micro_batch_size, train_batch_size,
    total_num_steps, warmup_num_steps, warmup_min_lr, scheduler`` (a schedule name), ``redundancy``
    (``"peer"`` or a ``zeroshard.PeerRedundancy``: the memory tier, no DeepSpeed key).
    ``auto``: values by the same names that only fill the config's "auto" entries.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    plan = translate(config, _world_size(process_group), overrides, strict=strict, auto=auto)
    if plan.optimizer_class is None:
        raise ValueError("the config has no 'optimizer' section; add one (e.g. {\"type\": \"AdamW\", \"params\": "
                         "{\"lr\": 1e-4}}) or pass optimizer=torch.optim.AdamW, lr=... to initialize")
    optimizer = build_optimizer(model, model_parameters, plan, process_group)
    scheduler = build_schedule(plan.scheduler, optimizer, plan.scheduler_params) if plan.scheduler else None
    return Initialized(model, optimizer, scheduler, plan)
