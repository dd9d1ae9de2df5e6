"""Where training state lives when it does not fit next to the model (offload): Adam
moments (``NvmeOptimizerState``) and each unit's gradient, master and shard
(``NvmeUnitStore``) in per-rank swap files (``swap_file``)."""
from zeroshard.offload.nvme_state import NvmeOptimizerState
from zeroshard.offload.unit_swap import NvmeUnitStore

__all__ = ["NvmeOptimizerState", "NvmeUnitStore"]
