"""Training-loop pieces around ZeroOptimizer, one concern per module:

- ``initialize`` / ``deepspeed_config``: a DeepSpeed JSON config -> (model, ZeroOptimizer, schedule);
- ``schedules``: WarmupLR / WarmupDecayLR / WarmupCosineLR with DeepSpeed's per-step values;
- ``preemption``: SIGTERM/SIGUSR1 -> every rank saves at the next step boundary;
- ``failures``: a dead or hung rank -> the others exit with a message instead of hanging;
- ``loop``: micro-batches, step, step-boundary agreement, checkpoints, resume;
- ``progress``: the rank-0 bar, per-rank log files, metrics and the final summary;
- ``text_data`` / ``model_loading``: a local text corpus and a Hugging Face causal LM;
- ``config`` / ``finetune``: ``examples/finetune_causal_lm.py`` and ``zeroshard finetune``;
- ``faults``: fault injection for tests; ``demo``: ``python -m zeroshard.train.demo``.
"""
from zeroshard.train.deepspeed_config import DeepSpeedPlan, translate
from zeroshard.train.failures import EXIT_PEER_FAILURE, StepWatchdog
from zeroshard.train.initialize_from_config import Initialized, initialize
from zeroshard.train.preemption import PreemptionHandler
from zeroshard.train.schedules import WarmupCosineLR, WarmupDecayLR, WarmupLR, build_schedule

__all__ = ["initialize", "Initialized", "DeepSpeedPlan", "translate", "WarmupLR", "WarmupDecayLR",
           "WarmupCosineLR", "build_schedule", "PreemptionHandler", "StepWatchdog", "EXIT_PEER_FAILURE"]
