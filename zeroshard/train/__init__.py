"""Training-loop pieces: DeepSpeed-config translation, schedules, preemption, progress.

- ``initialize``: a ZeroOptimizer and schedule from a DeepSpeed JSON config;
- ``schedules``: WarmupLR / WarmupDecayLR / WarmupCosineLR with DeepSpeed's semantics;
- ``finetune``: the ``zeroshard finetune`` command and ``examples/finetune_causal_lm.py``.
"""
from zeroshard.train.deepspeed_config import DeepSpeedPlan, translate
from zeroshard.train.initialize import Initialized, initialize
from zeroshard.train.schedules import WarmupCosineLR, WarmupDecayLR, WarmupLR, build_schedule

__all__ = ["initialize", "Initialized", "DeepSpeedPlan", "translate", "WarmupLR", "WarmupDecayLR",
           "WarmupCosineLR", "build_schedule"]
