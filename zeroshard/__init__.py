"""zeroshard: ZeRO stages as a drop-in torch.optim optimizer.

    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=3e-4, stage=2)

See docs/design.md for the architecture and README.md for the quick start.
"""
from zeroshard.config import AutoOffload, CPUOffload, NVMeOffload, ZeroConfig
from zeroshard.offload.activations import ActivationOffload
from zeroshard.offload.activations.workload import PlannedActivations
from zeroshard.memory import MemoryReport, zero_formula
from zeroshard.optim.zero_optimizer import ZeroOptimizer
from zeroshard.model.full_state import full_state_dict
from zeroshard.model.init_weights import init_meta_weights
from zeroshard.model.safetensors_load import load_safetensors
from zeroshard.model.chunked_loss import chunked_cross_entropy
from zeroshard.optim.shard_marker import ShardOnlySaveWarning
from zeroshard.checkpoint import export_hf, latest_checkpoint, load_checkpoint, save_checkpoint, wait_checkpoint
from zeroshard.resilience import PeerRedundancy
from zeroshard.checkpoint.memory_commit import memory_checkpoint
from zeroshard.checkpoint.memory_handoff import memory_handoff
from zeroshard.train.in_process import InProcessOptions, InProcessRecovery, Trainee

__version__ = "0.1.0"

__all__ = ["ZeroOptimizer", "ZeroConfig", "ActivationOffload", "PlannedActivations", "CPUOffload", "NVMeOffload", "AutoOffload", "MemoryReport", "zero_formula",
           "full_state_dict", "init_meta_weights", "load_safetensors", "ShardOnlySaveWarning", "__version__"]
__all__ += ["chunked_cross_entropy"]
__all__ += ["save_checkpoint", "load_checkpoint", "export_hf", "latest_checkpoint", "wait_checkpoint"]
__all__ += ["PeerRedundancy", "memory_checkpoint", "memory_handoff", "InProcessRecovery", "InProcessOptions", "Trainee"]
# initialize(model, config) -> (model, optimizer, scheduler); DeepSpeed's keyword form -> (engine, optimizer,
# dataloader, scheduler), so `import zeroshard as deepspeed` runs DeepSpeed scripts (zeroshard/deepspeed_compat/)
from zeroshard.deepspeed_compat import accelerator, add_config_arguments, init_distributed, initialize, zero  # noqa: E402
import sys as _sys  # noqa: E402
_sys.modules.setdefault("zeroshard.zero", zero)  # (`from zeroshard.zero import GatheredParameters`)
_sys.modules.setdefault("zeroshard.accelerator", accelerator)  # (`from zeroshard.accelerator import get_accelerator`)
from zeroshard.deepspeed_compat import checkpointing  # noqa: E402 - deepspeed.checkpointing.checkpoint/configure
_sys.modules.setdefault("zeroshard.checkpointing", checkpointing)  # (`from zeroshard.checkpointing import checkpoint`)
__all__ += ["initialize", "add_config_arguments", "init_distributed", "zero", "accelerator", "checkpointing"]
from zeroshard.integrations.peft_export import export_merged, save_adapter  # noqa: E402 - PEFT (LoRA) exports
__all__ += ["save_adapter", "export_merged"]
