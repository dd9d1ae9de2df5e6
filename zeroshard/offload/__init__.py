"""Where optimizer state lives when it does not fit next to the model (offload)."""
from zeroshard.offload.nvme_state import NvmeOptimizerState

__all__ = ["NvmeOptimizerState"]
