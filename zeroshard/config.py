"""Configuration of a ZeroOptimizer: one frozen, validated dataclass.

Every field is checked in ``__post_init__`` so that a typo fails at construction with a
message that names the offending value and the fix, not deep inside the first step.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

_STAGES = (0, 1, 2, 3)
_OFFLOAD = (None, "cpu", "nvme")
_PRECISIONS = (None, "bf16", "fp16")


@dataclass(frozen=True)
class ZeroConfig:
    """How parameters, gradients and optimizer state are partitioned and kept."""

    stage: int = 2
    """0 = plain data parallel, 1 = shard optimizer state, 2 = + gradients, 3 = + parameters."""
    offload_optimizer: Optional[str] = None
    """Where fp32 master pieces and optimizer moments live: None (device), "cpu" or "nvme"."""
    offload_params: Optional[str] = None
    """Stage 3 only: where parameter slices live between gathers: None, "cpu" or "nvme"."""
    nvme_path: Optional[str] = None
    """Directory for the swap files of "nvme" offload."""
    mixed_precision: Optional[str] = None
    """None (fp32 everywhere), "bf16" or "fp16": the model's parameter dtype; the master
    pieces stay fp32. fp16 adds dynamic loss scaling."""
    bucket_size_mb: float = 25.0
    """Size of a flat unit (stages 0-2) in MiB of parameter data: the granularity of
    gradient reduction and of the parameter gather after the step."""
    max_inflight_buckets: int = 2
    """How many gradient buckets may be in flight at once (stage 2 keeps at most this many
    full-size bucket buffers alive; more overlap costs more memory)."""
    reduce_dtype: Optional[str] = None
    """dtype of gradient buffers and reductions: None = fp32 (exact accumulation, the
    default even under bf16/fp16), or "bf16"/"fp16" to halve gradient memory and traffic."""
    max_live_units: int = 2
    """Stage 3: how many units (besides the root unit) may be gathered or being prefetched
    at once; bounds the gather buffers to about that many units."""
    stage3_unit_classes: Optional[tuple[str, ...]] = None
    """Stage 3: class names of the modules that form units (default: every repeated block,
    e.g. each transformer layer)."""
    stage3_unit_numel: Optional[int] = None
    """Stage 3: instead of classes, the largest subtrees with at most this many parameters."""
    offload_buffer_mb: Optional[float] = None
    """NVMe offload: bound on the host memory of its staging buffers (the moments' pool and
    the units in flight between the swap files and the step), in MiB. Each overlapped stage
    of the read-update-write pipeline takes one slot of about the largest unit's state; None
    allows three slots (full overlap). Too small for one slot fails at construction."""
    fused_adam: bool = True
    """Run torch.optim.Adam/AdamW on zeroshard's fused kernel (same results, one pass over
    memory). Other optimizers, or Adam options the kernel does not implement, always run
    on the class given."""
    initial_loss_scale: float = 2.0**16
    """fp16 only: starting dynamic loss scale."""
    loss_scale_growth_interval: int = 2000
    """fp16 only: overflow-free steps before the loss scale doubles."""

    def __post_init__(self) -> None:
        if self.stage not in _STAGES:
            raise ValueError(f"stage={self.stage!r} is not a ZeRO stage; use one of {_STAGES}")
        for name in ("offload_optimizer", "offload_params"):
            value = getattr(self, name)
            if value not in _OFFLOAD:
                raise ValueError(f"{name}={value!r} is not supported; use one of {_OFFLOAD}")
        if self.offload_params is not None and self.stage != 3:
            raise ValueError(
                f"offload_params={self.offload_params!r} needs stage=3 (parameters are only "
                f"partitioned at stage 3), got stage={self.stage}")
        if self.offload_params == "nvme" and self.offload_optimizer != "nvme":
            raise ValueError(
                f"offload_params='nvme' needs offload_optimizer='nvme' too (got {self.offload_optimizer!r}): "
                "the fp32 master of a swapped parameter shard lives in the same swap file as the "
                "shard, and its optimizer states are streamed beside it")
        uses_nvme = "nvme" in (self.offload_optimizer, self.offload_params)
        if uses_nvme and not self.nvme_path:
            raise ValueError("offload to 'nvme' needs nvme_path=<directory for swap files>")
        if self.mixed_precision not in _PRECISIONS:
            raise ValueError(
                f"mixed_precision={self.mixed_precision!r} is not supported; use one of {_PRECISIONS}")
        if self.reduce_dtype not in (None, "fp32", "bf16", "fp16"):
            raise ValueError(
                f"reduce_dtype={self.reduce_dtype!r} is not supported; use None, 'fp32', 'bf16' or 'fp16'")
        if not self.bucket_size_mb > 0:
            raise ValueError(f"bucket_size_mb={self.bucket_size_mb!r} must be > 0")
        if self.max_inflight_buckets < 1:
            raise ValueError(f"max_inflight_buckets={self.max_inflight_buckets!r} must be >= 1")
        if self.max_live_units < 1:
            raise ValueError(f"max_live_units={self.max_live_units!r} must be >= 1")
        if self.stage3_unit_numel is not None and self.stage3_unit_numel < 1:
            raise ValueError(f"stage3_unit_numel={self.stage3_unit_numel!r} must be >= 1")
        if isinstance(self.stage3_unit_classes, str):
            raise TypeError(f"stage3_unit_classes={self.stage3_unit_classes!r} must be a list of "
                            "class names, e.g. ['GPT2Block']")
        if self.offload_buffer_mb is not None and not self.offload_buffer_mb > 0:
            raise ValueError(f"offload_buffer_mb={self.offload_buffer_mb!r} must be > 0 (MiB), or None")
        if not self.initial_loss_scale > 0:
            raise ValueError(f"initial_loss_scale={self.initial_loss_scale!r} must be > 0")
        if self.loss_scale_growth_interval < 1:
            raise ValueError(
                f"loss_scale_growth_interval={self.loss_scale_growth_interval!r} must be >= 1")

    @classmethod
    def field_names(cls) -> frozenset[str]:
        return frozenset(f.name for f in fields(cls))
