"""The precision policy of one ZeroOptimizer: the dtypes it computes, reduces and keeps masters in,
and, under fp16, the loss scale and the overflow check that skips a step.

Lifecycle: built once by the assembly (zeroshard/optim/assembly.py) from the config and the
trainable parameters' dtype. Under fp16, ``scale_loss`` marks each backward as scaled, the
step asks ``overflow`` once per backward pass (every rank agrees) and ``update`` moves the
scale; gradients are unscaled as each reduction retires (``grad_factor``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import torch

from zeroshard.precision.loss_scaler import DynamicLossScaler

if TYPE_CHECKING:
    from zeroshard.comm.process_group import Comm
    from zeroshard.config import ZeroConfig

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    def __init__(self, config: ZeroConfig, trainable_dtype: torch.dtype, pp: Optional[Comm] = None) -> None:
        self.mixed = config.mixed_precision is not None
        self.param_dtype: torch.dtype = _DTYPES[config.mixed_precision] if config.mixed_precision else trainable_dtype
        """The dtype the model computes in (the fp32 masters of mixed precision live in the units)."""
        widest = torch.float64 if self.param_dtype == torch.float64 else torch.float32
        self.reduce_dtype: torch.dtype = _DTYPES[config.reduce_dtype] if config.reduce_dtype else widest
        self.scaler = (DynamicLossScaler(config.initial_loss_scale, growth_interval=config.loss_scale_growth_interval)
                       if config.mixed_precision == "fp16" else None)
        self._scaled_pass = -1  # the backward pass scale_loss was called for
        self._checked_pass = -1  # the pass whose overflow flag is cached
        self._overflow = False
        self.pp = pp
        """Pipeline parallelism: the other stages' ranks, which agree on overflow too; the last
        stage's loss_fn scales the loss, so passes are not checked for being scaled here."""

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def bucket_numel(self, bucket_size_mb: float) -> int:
        """Elements of the model dtype in a gradient bucket of ``bucket_size_mb``."""
        return max(1, int(bucket_size_mb * 2**20) // torch.finfo(self.param_dtype).bits * 8)

    def grad_factor(self, data_parallel_size: int) -> float:
        """What each reduced gradient is multiplied by: averaged over ranks and unscaled."""
        return 1.0 / (data_parallel_size * self.loss_scale)

    def scale_loss(self, loss: torch.Tensor, passes: int) -> torch.Tensor:
        """The loss to call backward on, for the pass after the ``passes`` done so far."""
        self._scaled_pass = passes + 1
        return loss * self.scaler.scale if self.scaler is not None else loss

    def overflow(self, passes: int, got_grads: bool, local_overflow: Callable[[], bool], comm: Comm) -> bool:
        """fp16: whether any rank's gradients of the last backward pass hold an inf or a NaN (a
        collective, once per pass). Refuses gradients of an unscaled loss, which fp16 loses."""
        if self.scaler is None:
            return False
        if self._checked_pass != passes:
            if got_grads and self._scaled_pass < passes and self.pp is None:
                raise RuntimeError(
                    "mixed_precision='fp16' needs the loss scaled before backward: call "
                    "optimizer.backward(loss) or optimizer.scale_loss(loss).backward() instead "
                    "of loss.backward()")
            self._overflow = comm.any_true(local_overflow())
            if self.pp is not None:  # (one stage's inf skips every stage's step: Note [pipeline parallelism])
                self._overflow = self.pp.any_true(self._overflow)
            self._checked_pass = passes
        return self._overflow

    def update(self, overflow: bool) -> None:
        """After a step (or a step skipped for ``overflow``): the loss scale moves."""
        if self.scaler is not None:
            self.scaler.update(overflow)
