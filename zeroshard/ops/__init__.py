"""Fused Adam/AdamW kernels: C++ on CPU (AVX-512/AVX2, OpenMP), CUDA multi-tensor on GPU.

Public surface:

- ``FusedAdam``: a torch.optim.Optimizer, drop-in for torch.optim.AdamW / Adam.
- ``adam_step_`` (and ``adam_step_multi_`` for lists): one in-place step with the fused
  extras (gradient scale, bf16/fp16 gradients, bf16/fp16 copy-out of the parameter).
- ``squared_norm_f64``: a gradient's squared L2 norm accumulated in float64 (for clipping).
- ``kernel_status()``: what is active and why; ``python -m zeroshard.ops`` prints it.

Kernels are found installed (setup.py), else built just in time, else a pure-PyTorch path
runs and one warning says why.
"""
from __future__ import annotations

from ._functional import adam_step_, adam_step_multi_
from ._reference import reference_adam_step_
from ._status import kernel_status
from .fused_adam import FusedAdam
from .sqnorm import squared_norm_f64

__all__ = ["FusedAdam", "adam_step_", "adam_step_multi_", "kernel_status", "reference_adam_step_",
           "squared_norm_f64"]
