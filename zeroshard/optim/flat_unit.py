"""The tensors of one flat unit on one rank, and their lifecycle across a step.

A ``FlatUnit`` owns:
- ``flat``: the full parameter buffer (model dtype); every model parameter of the unit is
  a view into it, so the post-step gather writes straight into the model;
- ``master``: the fp32 values of the owned range that the optimizer updates. Without
  mixed precision it *is* the owned range of ``flat`` (no copy, no extra memory);
- ``grad_store``: reduced gradients, summed over ranks and micro-batches, in fp32: the
  whole unit (stages 0-1) or only the owned range (stage 2).
"""
from __future__ import annotations

from typing import Sequence

import torch

from zeroshard.layout import NamedParam, UnitLayout
from zeroshard.stages import StagePolicy


class FlatUnit:
    def __init__(self, layout: UnitLayout, members: Sequence[NamedParam], policy: StagePolicy,
                 rank: int, param_dtype: torch.dtype) -> None:
        self.layout = layout
        self.members = list(members)
        self.policy = policy
        device = self.members[0].param.device
        self.owned = layout.slice_of(rank) if policy.shard_optimizer else (0, layout.padded_numel)
        lo, hi = self.owned
        self.flat = torch.zeros(layout.padded_numel, dtype=param_dtype, device=device)
        separate_master = param_dtype != torch.float32
        if separate_master:
            self.master = torch.zeros(hi - lo, dtype=torch.float32, device=device)
        with torch.no_grad():
            for m, seg in zip(self.members, layout.segments):
                src = m.param.detach().reshape(-1)
                self.flat[seg.offset:seg.end].copy_(src)
                if separate_master:
                    a, b = max(lo, seg.offset), min(hi, seg.end)
                    if a < b:  # the master keeps the full-precision initial values
                        self.master[a - lo:b - lo].copy_(src[a - seg.offset:b - seg.offset])
                m.param.data = self.flat[seg.offset:seg.end].view(seg.shape)
        if not separate_master:
            self.master = self.flat[lo:hi]
        self.separate_master = separate_master
        self.grad_base = lo if policy.shard_gradients else 0
        store_numel = hi - lo if policy.shard_gradients else layout.padded_numel
        self.grad_store = torch.zeros(store_numel, dtype=torch.float32, device=device)
        self.grad_valid = False
        """False after zero_grad(set_to_none=True): the next reduced gradient overwrites."""

    # -- ranges ---------------------------------------------------------------------------
    def grad_range(self, a: int, b: int) -> torch.Tensor:
        return self.grad_store[a - self.grad_base:b - self.grad_base]

    def master_range(self, a: int, b: int) -> torch.Tensor:
        lo = self.owned[0]
        return self.master[a - lo:b - lo]

    def param_range(self, a: int, b: int) -> torch.Tensor:
        """Model-dtype values of unit range ``[a, b)``; at stages 0-2 any range is held."""
        return self.flat[a:b]

    def owned_grad(self) -> torch.Tensor:
        return self.grad_range(*self.owned)

    # -- step lifecycle -------------------------------------------------------------------
    def accumulate(self, reduced: torch.Tensor, base: int, factor: float) -> None:
        """Add ``factor *`` a reduced gradient whose element 0 sits at unit offset ``base``."""
        a = self.grad_base
        src = reduced[a - base:a - base + self.grad_store.numel()]
        if self.grad_valid:
            self.grad_store.add_(src, alpha=factor)
        else:
            torch.mul(src, factor, out=self.grad_store)
            self.grad_valid = True

    def write_back(self) -> None:
        """Copy updated master values into the model-dtype buffer (mixed precision)."""
        if self.separate_master:
            lo, hi = self.owned
            self.flat[lo:hi].copy_(self.master)

    def clear_grads(self, set_to_none: bool) -> None:
        if set_to_none:
            self.grad_valid = False
        else:
            self.grad_store.zero_()
            self.grad_valid = True
