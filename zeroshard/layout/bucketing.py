"""Grouping parameters into flat units (stages 0-2: buckets by size)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from zeroshard.layout.flat_unit import Segment, UnitLayout

# Slices are padded to a multiple of this many elements: 64 bytes of fp32, enough for
# aligned vector loads in the kernels and cheap (< world_size * 16 elements per unit).
ALIGN_ELEMENTS = 16


@dataclass(frozen=True)
class NamedParam:
    name: str
    param: torch.nn.Parameter
    group: int


def _layout(index: int, ordered: Sequence[NamedParam], world_size: int) -> UnitLayout:
    segments, offset = [], 0
    for m in ordered:
        n = m.param.numel()
        segments.append(Segment(m.name, m.param.shape, offset, n, m.group))
        offset += n
    quantum = world_size * ALIGN_ELEMENTS
    padded = max(quantum, -(-offset // quantum) * quantum)
    return UnitLayout(index, tuple(segments), padded, world_size)


def build_layouts(params: Sequence[NamedParam], bucket_numel: int, world_size: int
                  ) -> list[tuple[UnitLayout, list[NamedParam]]]:
    """Split parameters into units of about ``bucket_numel`` elements.

    Units are filled in *reverse* registration order because backward produces gradients
    roughly in that order: unit 0 is the first whose gradients are complete, so reducing
    units in index order overlaps communication with the rest of backward.
    """
    if bucket_numel < 1:
        raise ValueError(f"bucket_numel={bucket_numel} must be >= 1")
    units: list[list[NamedParam]] = [[]]
    size = 0
    for np_ in reversed(params):
        n = np_.param.numel()
        if units[-1] and size + n > bucket_numel:
            units.append([])
            size = 0
        units[-1].append(np_)
        size += n
    # Group-major order inside a unit keeps each param group contiguous (stable sort).
    ordered = [sorted(u, key=lambda m: m.group) for u in units if u]
    return [(_layout(i, members, world_size), members) for i, members in enumerate(ordered)]
