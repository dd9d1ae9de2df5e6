"""A DeepSpeed-compatible front: ``import zeroshard as deepspeed`` for the config subset
zeroshard supports, and ``convert_deepspeed`` for DeepSpeed ZeRO checkpoints.

Files, one object each: ``initialize`` (``initialize``, ``add_config_arguments``,
``init_distributed``), ``engine`` (``DeepSpeedEngine``), ``zero`` (``GatheredParameters``), ``accelerator``
(``get_accelerator``), ``checkpointing`` (``checkpoint``, ``configure``),
``convert`` (``convert_deepspeed`` and its command), ``restricted_unpickler`` (reading
DeepSpeed's ``.pt`` files without running pickled code).
"""
from zeroshard.deepspeed_compat import accelerator, checkpointing, zero
from zeroshard.deepspeed_compat.engine import DeepSpeedEngine
from zeroshard.deepspeed_compat.initialize import (add_config_arguments, deepspeed_initialize, init_distributed,
                                                   initialize)

__all__ = ["DeepSpeedEngine", "initialize", "deepspeed_initialize", "add_config_arguments", "init_distributed",
           "zero", "accelerator", "checkpointing"]
