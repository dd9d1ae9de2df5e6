"""zeroshard: ZeRO stages as a drop-in torch.optim optimizer.

    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=3e-4, stage=2)

See docs/design.md for the architecture and README.md for the quick start.
"""
from zeroshard.config import ZeroConfig
from zeroshard.memory import MemoryReport, zero_formula
from zeroshard.optim.zero_optimizer import ZeroOptimizer

__version__ = "0.1.0"

__all__ = ["ZeroOptimizer", "ZeroConfig", "MemoryReport", "zero_formula", "__version__"]
