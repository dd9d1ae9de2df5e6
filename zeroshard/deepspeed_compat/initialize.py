"""``deepspeed.initialize`` and its helpers, so ``import zeroshard as deepspeed`` runs a
DeepSpeed script for the config subset zeroshard supports (``train/deepspeed_config.py``).

``zeroshard.initialize`` keeps its own form too: called with the model as its first
positional argument (``zeroshard.initialize(model, config)``) it returns ``(model,
optimizer, scheduler)``; called as DeepSpeed is called (keywords, ``args`` first) it returns
DeepSpeed's ``(engine, optimizer, training_dataloader, lr_scheduler)``.
"""
from __future__ import annotations

import argparse
import datetime
import os
from typing import Any, Callable, Iterable, Mapping, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

from zeroshard.deepspeed_compat.engine import DeepSpeedEngine
from zeroshard.optim.zero_optimizer import ZeroOptimizer
from zeroshard.train.deepspeed_config import PLACEHOLDER, load_config, translate
from zeroshard.train.deepspeed_zeropp import hpz_mesh
from zeroshard.train.initialize_from_config import build_optimizer, check_model_parameters
from zeroshard.train.initialize_from_config import initialize as zeroshard_initialize
from zeroshard.train.schedules import build_schedule

ConfigLike = Union[None, str, os.PathLike, Mapping]

# Config keys the front reads itself (the translator knows only what ZeroOptimizer needs).
FRONT_KEYS = ("dataloader_drop_last",)


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's command-line flags: ``--deepspeed``, ``--deepspeed_config`` (and the old
    ``--deepscale`` spellings); returns the parser."""
    if not isinstance(parser, argparse.ArgumentParser):
        raise TypeError(f"add_config_arguments(parser): expected an argparse.ArgumentParser, got "
                        f"{type(parser).__name__}")
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (kept for DeepSpeed scripts; zeroshard always runs)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


def init_distributed(dist_backend: Optional[str] = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = 29500, verbose: bool = True,
                     timeout: datetime.timedelta = datetime.timedelta(minutes=30), init_method: Optional[str] = None,
                     dist_init_required: Optional[bool] = None, config: object = None, rank: int = -1,
                     world_size: int = -1) -> None:
    """Starts ``torch.distributed`` as DeepSpeed's launcher environment describes it (RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT: what ``torchrun`` sets); without that environment,
    a process group of one. Does nothing if one is already initialized."""
    if dist_init_required is False or dist.is_initialized():
        return
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    env_rank = os.environ.get("RANK")
    if rank < 0 and env_rank is None and init_method is None:
        # A plain `python train.py`: one process, no rendezvous (DeepSpeed would try MPI here).
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(distributed_port))
    kwargs: dict[str, Any] = {"timeout": timeout, "init_method": init_method}
    if rank >= 0:
        kwargs["rank"] = rank
    if world_size >= 0:
        kwargs["world_size"] = world_size
    dist.init_process_group(backend, **kwargs)


def _config_of(args: object, config: ConfigLike, config_params: ConfigLike) -> ConfigLike:
    if config is not None and config_params is not None:
        raise ValueError("initialize: pass config= or config_params= (the same thing), not both")
    config = config if config is not None else config_params
    from_args = None
    if args is not None:
        from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if from_args is not None and config is not None:
        raise ValueError(f"initialize: a config came both as --deepspeed_config ({from_args!r}) and as config=; "
                         "pass one of them")
    config = config if config is not None else from_args
    if config is None:
        raise ValueError("initialize: no DeepSpeed config; pass config=<dict or json path> or --deepspeed_config")
    return config


def _launched() -> bool:
    """Whether a launcher (torchrun, DeepSpeed's) describes this process as a rank of a job."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _refuse_auto_precision(raw: Mapping) -> None:
    """``"enabled": "auto"`` is the Hugging Face Trainer's placeholder; nothing fills it in
    ``deepspeed.initialize``, and reading it as "off" would silently train in fp32."""
    for section in ("fp16", "bf16", "bfloat16"):
        body = raw.get(section)
        if isinstance(body, Mapping) and body.get("enabled") == PLACEHOLDER:
            raise ValueError(f"{section}.enabled is \"auto\" (a placeholder the Hugging Face Trainer fills in); "
                             "deepspeed.initialize has nothing to fill it from. Set it to true or false, or call "
                             "zeroshard.initialize(model, config, mixed_precision=\"fp16\"|\"bf16\"|None)")


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _rebuild_optimizer(optimizer: torch.optim.Optimizer) -> tuple[type, list[dict], dict]:
    """A client optimizer's class, groups and defaults, to build the ZeroOptimizer from."""
    if isinstance(optimizer, ZeroOptimizer):
        raise ValueError("initialize(optimizer=...) got a ZeroOptimizer; pass the model and let initialize "
                         "build it, or use that optimizer directly without initialize")
    if len(optimizer.state):
        raise ValueError(f"initialize(optimizer=...): the {type(optimizer).__name__} already holds state; "
                         "pass a freshly built one (its state cannot be resharded)")
    defaults = {k: v for k, v in optimizer.defaults.items() if v is not None}  # (None: torch's "unset")
    groups = [{"params": list(g["params"]), **{k: v for k, v in g.items()
                                                if k != "params" and k in defaults and v != defaults[k]}}
              for g in optimizer.param_groups]
    return type(optimizer), groups, defaults


def deepspeed_initialize(args: object = None, model: Optional[nn.Module] = None,
                         optimizer: Optional[torch.optim.Optimizer] = None,
                         model_parameters: Optional[Iterable] = None, training_data: Optional[Dataset] = None,
                         lr_scheduler: Optional[Callable] = None, distributed_port: int = 29500, mpu: object = None,
                         dist_init_required: Optional[bool] = None, collate_fn: Optional[Callable] = None,
                         config: ConfigLike = None, mesh_param: object = None, config_params: ConfigLike = None,
                         **unknown: object) -> tuple:
    """DeepSpeed's ``initialize``: ``(engine, optimizer, training_dataloader, lr_scheduler)``."""
    if unknown:
        raise TypeError(f"initialize got unexpected argument(s) {sorted(unknown)}. DeepSpeed's form takes "
                        "args, model, optimizer, model_parameters, training_data, lr_scheduler, collate_fn, "
                        "config; zeroshard's own form takes the model first: zeroshard.initialize(model, config, "
                        "stage=..., lr=...)")
    if not isinstance(model, nn.Module):
        raise TypeError(f"initialize(model=...) must be an nn.Module, got {type(model).__name__}")
    for name, value in (("mpu", mpu), ("mesh_param", mesh_param)):
        if value is not None:
            raise ValueError(f"initialize({name}=...) is not supported: zeroshard's DeepSpeed front is data "
                             "parallel only (use ZeroOptimizer(..., mesh=...) for tensor parallelism)")
    if not dist.is_initialized() and dist_init_required is not False and _launched():
        init_distributed(distributed_port=distributed_port)  # (as DeepSpeed's initialize does)
    raw = load_config(_config_of(args, config, config_params))
    _refuse_auto_precision(raw)
    front = {k: raw.pop(k) for k in FRONT_KEYS if k in raw}
    drop_last = front.get("dataloader_drop_last", False)
    if not isinstance(drop_last, bool):
        raise ValueError(f"dataloader_drop_last={drop_last!r} must be true or false")
    plan = translate(raw, _world())
    if optimizer is not None and plan.optimizer_class is not None:
        raise ValueError("initialize: the config has an 'optimizer' section and optimizer= was passed too; "
                         "remove one of them")
    if optimizer is None and plan.optimizer_class is None:
        raise ValueError("initialize: no optimizer; add an 'optimizer' section to the config (e.g. {\"type\": "
                         "\"AdamW\", \"params\": {\"lr\": 1e-4}}) or pass optimizer=")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"initialize(optimizer=...) must be a torch.optim.Optimizer instance, got "
                        f"{type(optimizer).__name__} (a callable that builds one is not supported)")
    if lr_scheduler is not None and not callable(lr_scheduler):
        raise TypeError(f"initialize(lr_scheduler=...) must be a callable optimizer -> scheduler, got "
                        f"{type(lr_scheduler).__name__}")
    if isinstance(lr_scheduler, torch.optim.lr_scheduler.LRScheduler):
        raise TypeError("initialize(lr_scheduler=...) got a scheduler built on another optimizer; pass a "
                        "callable instead: lr_scheduler=lambda opt: torch.optim.lr_scheduler.X(opt, ...)")
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if not any(p.is_meta for p in model.parameters()) and plan.zero.get("offload_params") is None:
        model.to(device)  # (DeepSpeed moves the model to its device too)
    if optimizer is not None:
        opt_class, groups, opt_kwargs = _rebuild_optimizer(optimizer)
        check_model_parameters(model, groups)
        # module=: stage 3 partitions by module even when param groups are given.
        zero_opt = ZeroOptimizer(groups, opt_class, module=model, mesh=hpz_mesh(plan.hpz_partition_size),
                                 **plan.zero, **opt_kwargs)
    else:  # the config's optimizer: the path zeroshard.initialize takes (Muon's recipe included)
        zero_opt = build_optimizer(model, model_parameters, plan)
    if lr_scheduler is not None:
        scheduler = lr_scheduler(zero_opt)
    elif plan.scheduler:
        scheduler = build_schedule(plan.scheduler, zero_opt, plan.scheduler_params)
    else:
        scheduler = None
    loader = None
    if training_data is not None:
        loader = _dataloader(training_data, plan.micro_batch_size, zero_opt, collate_fn, drop_last)
    engine = DeepSpeedEngine(model, zero_opt, scheduler, plan, {**raw, **front}, loader, device)
    return engine, zero_opt, loader, scheduler


def _dataloader(dataset: Dataset, micro: Optional[int], opt: ZeroOptimizer, collate_fn: Optional[Callable],
                drop_last: bool) -> torch.utils.data.DataLoader:
    """DeepSpeed's training loader: a DistributedSampler over the data-parallel ranks (shuffled,
    seed 0) and micro-batches of ``train_micro_batch_size_per_gpu``."""
    if not isinstance(dataset, torch.utils.data.Dataset):
        raise TypeError(f"initialize(training_data=...) must be a torch Dataset, got {type(dataset).__name__}")
    if micro is None:
        raise ValueError("initialize(training_data=...) needs train_micro_batch_size_per_gpu (or train_batch_size) "
                         "in the config to batch it")
    world, rank = _world(), (dist.get_rank() if _world() > 1 else 0)
    sampler: torch.utils.data.DistributedSampler = torch.utils.data.DistributedSampler(dataset, num_replicas=world, rank=rank)
    return torch.utils.data.DataLoader(dataset, batch_size=micro, sampler=sampler, collate_fn=collate_fn,
                                       drop_last=drop_last)


def initialize(*args: Any, **kwargs: Any) -> tuple:
    """``zeroshard.initialize(model, config, **overrides)`` -> ``(model, optimizer, scheduler)``
    (zeroshard's form: the model first), or DeepSpeed's ``initialize(args=None, model=...,
    model_parameters=..., config=..., training_data=...)`` -> ``(engine, optimizer,
    training_dataloader, lr_scheduler)``."""
    if args and isinstance(args[0], nn.Module):
        return zeroshard_initialize(*args, **kwargs)
    return deepspeed_initialize(*args, **kwargs)


__all__ = ["initialize", "deepspeed_initialize", "add_config_arguments", "init_distributed"]
