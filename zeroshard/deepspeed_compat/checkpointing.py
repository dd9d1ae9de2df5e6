"""``deepspeed.checkpointing`` for scripts run with ``import zeroshard as deepspeed``: ``configure``
and ``checkpoint`` (what Megatron-style models call), on ``torch.utils.checkpoint`` (non-reentrant).

With ``checkpoint_in_cpu`` (the config's ``activation_checkpointing.cpu_checkpointing``) each
checkpointed call's inputs wait for backward in host memory: through the ZeroOptimizer's
activation offload when one is active for the model (``offload_activations``, which
``zeroshard.initialize`` sets from the same key: Note [activation offload]), else through
torch's ``save_on_cpu`` around the call (its hooks see only the checkpoint's inputs: inside the
call the checkpoint's own hooks are innermost). What each key does here:
zeroshard/train/deepspeed_activations.py.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Union, cast

import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from zeroshard.offload.activations import offloader
from zeroshard.train.deepspeed_activations import SECTION, read_section
from zeroshard.train.deepspeed_config import load_config


@dataclass(frozen=True)
class CheckpointingSettings:
    """What ``configure`` was given, checked: a value that cannot be honoured is refused with the fix."""

    checkpoint_in_cpu: bool = False
    partition_activations: bool = False
    contiguous_checkpointing: bool = False
    num_checkpoints: Optional[int] = None
    synchronize: bool = False
    model_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("checkpoint_in_cpu", "partition_activations", "contiguous_checkpointing", "synchronize"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"deepspeed.checkpointing.configure({name}={getattr(self, name)!r}): pass True or False")
        n = self.num_checkpoints
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"deepspeed.checkpointing.configure(num_checkpoints={n!r}): an int >= 1, or None")
        if self.partition_activations and not self.checkpoint_in_cpu:
            raise ValueError(
                "deepspeed.checkpointing.configure(partition_activations=True): zeroshard does not split checkpointed "
                "inputs over model-parallel ranks; pass checkpoint_in_cpu=True instead (the inputs leave the device "
                "whole, to host memory), or partition_activations=False")


_settings: Optional[CheckpointingSettings] = None


def configure(mpu_: object = None, deepspeed_config: Union[None, str, "os.PathLike[str]", Mapping] = None,
              partition_activations: Optional[bool] = None, contiguous_checkpointing: Optional[bool] = None,
              num_checkpoints: Optional[int] = None, checkpoint_in_cpu: Optional[bool] = None,
              synchronize: Optional[bool] = None, profile: Optional[bool] = None) -> None:
    """DeepSpeed's signature: the config's ``activation_checkpointing`` section first, then the
    keyword arguments over it. ``profile`` (DeepSpeed's timers) is refused when true."""
    global _settings
    if profile:
        raise ValueError("deepspeed.checkpointing.configure(profile=True): zeroshard has no checkpoint timers; use "
                         "torch.profiler, or profile=False")
    section = load_config(deepspeed_config).get(SECTION) if deepspeed_config is not None else None
    read_section(section)  # (checks its values)
    got = section if isinstance(section, dict) else {}

    def pick(given: object, key: str, default: object) -> bool:  # (the keyword over the config; checked below)
        return cast(bool, given if given is not None else got.get(key, default))
    _settings = CheckpointingSettings(
        checkpoint_in_cpu=pick(checkpoint_in_cpu, "cpu_checkpointing", False),
        partition_activations=pick(partition_activations, "partition_activations", False),
        contiguous_checkpointing=pick(contiguous_checkpointing, "contiguous_memory_optimization", False),
        num_checkpoints=cast(Optional[int], pick(num_checkpoints, "number_checkpoints", None)),
        synchronize=pick(synchronize, "synchronize_checkpoint_boundary", False),
        model_parallel=mpu_ is not None)


def is_configured() -> bool:
    return _settings is not None


def reset() -> None:
    """Forgets ``configure``'s settings (DeepSpeed's ``reset`` frees its buffers; there are none here)."""
    global _settings
    _settings = None


def checkpoint(function: Callable, *args: object) -> object:
    """``function(*args)``, its activations recomputed in backward (``torch.utils.checkpoint``,
    non-reentrant: same values, RNG state replayed); with ``checkpoint_in_cpu`` its inputs wait
    in host memory."""
    if _settings is None or not _settings.checkpoint_in_cpu or offloader.hooks_active():
        return torch_checkpoint(function, *args, use_reentrant=False)
    with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
        return torch_checkpoint(function, *args, use_reentrant=False)
