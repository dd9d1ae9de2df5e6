"""Grouping parameters into flat units (stages 0-2: buckets by size)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

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
    shape: Optional[torch.Size] = None
    """The parameter's true shape when its data is not materialised (meta-device models)."""

    @property
    def true_shape(self) -> torch.Size:
        return self.shape if self.shape is not None else self.param.shape


def _layout(index: int, ordered: Sequence[NamedParam], world_size: int) -> UnitLayout:
    segments, offset = [], 0
    for m in ordered:
        n = m.true_shape.numel()
        segments.append(Segment(m.name, m.true_shape, offset, n, m.group))
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
        n = np_.true_shape.numel()
        if units[-1] and size + n > bucket_numel:
            units.append([])
            size = 0
        units[-1].append(np_)
        size += n
    return layouts_for([u for u in units if u], world_size)


def layouts_for(units: Sequence[Sequence[NamedParam]], world_size: int, first_index: int = 0
                ) -> list[tuple[UnitLayout, list[NamedParam]]]:
    """Layouts for given groupings of parameters (unit ``first_index + i`` = ``units[i]``)."""
    # Group-major order inside a unit keeps each param group contiguous (stable sort).
    ordered = [sorted(u, key=lambda m: m.group) for u in units]
    return [(_layout(first_index + i, members, world_size), members) for i, members in enumerate(ordered)]
