"""Accounting of the model-state bytes a rank holds, and the ZeRO formulas to compare with.

The formulas are those of the ZeRO paper (Rajbhandari et al., 2020, section 5), written
per category for Ψ trainable parameters on N ranks with K bytes of optimizer state per
parameter, and the byte widths zeroshard actually uses (gradients are kept in fp32, so
mixed precision pays 4Ψ for gradients where the paper's fp16 scheme pays 2Ψ):

    stage | parameters | gradients | master weights      | optimizer states
    0     | p·Ψ        | 4Ψ        | m·Ψ                 | K·Ψ
    1     | p·Ψ        | 4Ψ        | m·Ψ/N               | K·Ψ/N
    2     | p·Ψ        | 4Ψ/N      | m·Ψ/N               | K·Ψ/N
    3     | p·Ψ/N      | 4Ψ/N      | m·Ψ/N               | K·Ψ/N

plus, at stage 3, the gather buffers of the units alive at once (``max_live_units`` blocks
and the root unit), reported as ``buffers``, not model state. hpZ (``hpz=True``, nodes of k
ranks) adds ``secondary`` = p·Ψ/k; hybrid sharding (``mesh=`` alone) divides by k, not N.

with p the model dtype's width (4 fp32, 2 bf16/fp16), m = 4 under mixed precision and 0
in fp32 (the parameters are the master), K = 8 for Adam/AdamW.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

import torch

from zeroshard.io.buffers import held_bytes


def tensor_bytes(t: torch.Tensor, seen: Optional[set[int]] = None) -> int:
    """Bytes of ``t``'s storage, counted once per storage when ``seen`` is shared."""
    if t.numel() == 0:
        return 0
    key = t.untyped_storage().data_ptr()
    if seen is not None:
        if key in seen:
            return 0
        seen.add(key)
    return held_bytes(t)


@dataclass(frozen=True)
class MemoryReport:
    parameters: int
    gradients: int
    master_weights: int
    optimizer_states: int
    buffers: int = 0
    """Transient communication buckets (and stage-3 gather buffers) alive at the moment."""
    offloaded: int = 0
    """Bytes of state kept in NVMe swap files rather than in memory (not in model_states)."""
    frozen: int = 0
    """The part of ``parameters`` that is frozen weights (``requires_grad=False``), in memory."""
    frozen_offloaded: int = 0
    """The part of ``offloaded`` that is frozen weights (stage 3 with ``offload_params="nvme"``)."""
    activations_moved: int = 0
    """``offload_activations``: bytes of saved activations moved off the device and back in the
    last whole step (not held: a figure of traffic, beside the memory)."""
    secondary: int = 0
    """hpZ (stage 3, ``hpz=True``): the secondary parameter partition inside the node, p·Ψ/k
    for node size k (ZeRO++'s cost), on top of the primary p·Ψ/N in ``parameters``."""
    memory_tier: int = 0
    """``redundancy="peer"``: node-local shared memory this rank's tier slots take (its own two
    slots and the two it keeps for its buddy) plus its staging buffer (not in model_states)."""

    @property
    def model_states(self) -> int:
        return self.parameters + self.gradients + self.master_weights + self.optimizer_states + self.secondary

    def as_dict(self) -> dict[str, int]:
        d = asdict(self)
        # Keys of what only some runs have (hpZ, frozen weights) appear when nonzero, so the
        # other configurations keep their keys.
        for key in ("secondary", "frozen", "frozen_offloaded", "memory_tier", "activations_moved"):
            if not d[key]:
                del d[key]
        return {**d, "model_states": self.model_states}

    def __str__(self) -> str:
        mib = lambda n: f"{n / 2**20:8.2f} MiB"  # noqa: E731
        return (f"params {mib(self.parameters)} | grads {mib(self.gradients)} | master "
                f"{mib(self.master_weights)} | optim {mib(self.optimizer_states)} | buffers {mib(self.buffers)}"
                + (f" | on NVMe {mib(self.offloaded)}" if self.offloaded else "")
                + (f" (frozen: {mib(self.frozen)} in memory, {mib(self.frozen_offloaded)} on NVMe)"
                   if self.frozen or self.frozen_offloaded else "")
                + (f" | hpZ secondary {mib(self.secondary)}" if self.secondary else "")
                + (f" | memory tier {mib(self.memory_tier)}" if self.memory_tier else "")
                + (f" | activations moved per step {mib(self.activations_moved)}" if self.activations_moved else ""))


def zero_formula(stage: int, numel: int, world_size: int, *, param_bytes: int = 4,
                 mixed_precision: bool = False, optim_bytes_per_param: float = 8) -> MemoryReport:
    """Expected model-state bytes per rank by the ZeRO paper's formulas (module docstring)."""
    n = world_size
    shard = (lambda x: x / n) if stage >= 1 else (lambda x: x)
    master = 4 if mixed_precision else 0
    return MemoryReport(
        parameters=int(param_bytes * numel / n if stage >= 3 else param_bytes * numel),
        gradients=int(4 * numel / n if stage >= 2 else 4 * numel),
        master_weights=int(shard(master * numel)),
        optimizer_states=int(shard(optim_bytes_per_param * numel)),
    )
