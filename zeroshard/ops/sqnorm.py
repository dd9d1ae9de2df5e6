"""``squared_norm_f64``: the sum of squares of a tensor, accumulated in float64.

Gradient clipping sums this over every owned gradient piece (and over ranks), so it runs over
the whole model each step. ``torch.linalg.vector_norm(g, dtype=torch.float64)`` converts every
element through a float64 temporary, ~18x below memory speed; the CPU kernel
(csrc/adam/grad_sqnorm.cpp) reads the floats once, and its result does not depend on the thread
count (Note [deterministic sqnorm] there). Other tensors (CUDA, bf16, non-contiguous), and CPU
tensors where the kernel is not built, take the torch expression, which agrees to rounding.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ._loader import REGISTRY


def squared_norm_f64(t: Tensor) -> Tensor:
    """``sum(t ** 2)`` as a 0-dim float64 tensor on ``t``'s device."""
    if t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous():
        state = REGISTRY.cpu()
        if state.module is not None and hasattr(state.module, "sqnorm_f64"):
            return state.module.sqnorm_f64(t)
    return torch.linalg.vector_norm(t, 2.0, dtype=torch.float64) ** 2.0
