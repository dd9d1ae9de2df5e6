"""Grouping parameters into flat units (stages 0-2: buckets by size; whole-tensor units).

Note [whole-tensor units]: an optimizer whose update of a parameter reads the whole tensor
(Muon's orthogonalisation, Adafactor's factored moments, a user's class) cannot run on the
flat slices ZeRO gives each rank. Its parameters go into *owner layouts* instead: each rank's
slice of such a unit (slot r = ``slice_of(r)``) holds whole parameters only, every
parameter in one slot, slots padded to equal size. The reduce-scatter of the unit's
gradient then delivers each parameter's full averaged gradient to its owner alone (a reduce
to the owner, one collective for the whole unit), the owner runs the optimizer's own update
on the whole tensor with its whole state, and the all-gather after the step (or stage 3's
gathers) brings the new values to every rank: one exchange in, one out, each matrix updated
once. Owners are chosen by cost, longest first to the least-loaded rank (``update_cost``:
Newton-Schulz is about m·n·min(m, n) flops), and the ranks' lists are zipped into units so
a unit's slots hold parameters of similar size (little padding).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from zeroshard.layout.unit_layout import Segment, UnitLayout

# Slices are padded to a multiple of this many elements: 64 bytes of fp32, enough for
# aligned vector loads in the kernels and cheap (< world_size * 16 elements per unit).
ALIGN_ELEMENTS = 16


@dataclass(frozen=True)
class NamedParam:
    name: str
    param: torch.Tensor  # (an nn.Parameter, or a leaf tensor given as a parameter)
    group: int
    shape: Optional[torch.Size] = None
    """The parameter's true shape when its data is not materialised (meta-device models)."""

    @property
    def true_shape(self) -> torch.Size:
        return self.shape if self.shape is not None else self.param.shape

    @property
    def flat_numel(self) -> int:
        """The elements it takes in a real flat buffer (twice its numel when complex)."""
        return self.true_shape.numel() * (2 if self.param.dtype.is_complex else 1)


def _segment(m: NamedParam, offset: int) -> Segment:
    """``m``'s segment at ``offset``, or at the next even offset when complex (Note [complex
    parameters] in unit_layout.py)."""
    if not m.param.dtype.is_complex:
        return Segment(m.name, m.true_shape, offset, m.flat_numel, m.group)
    offset += offset % 2
    return Segment(m.name, torch.Size((*m.true_shape, 2)), offset, m.flat_numel, m.group, m.param.dtype)


def _layout(index: int, ordered: Sequence[NamedParam], world_size: int) -> UnitLayout:
    segments: list[Segment] = []
    offset = 0
    for m in ordered:
        segments.append(_segment(m, offset))
        offset = segments[-1].end
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
        n = np_.flat_numel
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


def update_cost(shape: torch.Size) -> int:
    """The relative cost of one whole-tensor update of a parameter of ``shape``: m·n·min(m, n)
    for a matrix (Newton-Schulz's products; higher dimensions flattened after the first), its
    element count otherwise."""
    if len(shape) < 2:
        return max(1, shape.numel())
    m = shape[0]
    n = shape.numel() // max(1, m)
    return max(1, m * n * min(m, n))


def assign_owners(params: Sequence[NamedParam], world_size: int,
                  cost: Callable[[torch.Size], int] = update_cost,
                  loads: Optional[list[int]] = None) -> list[list[NamedParam]]:
    """Each rank's whole parameters: longest processing time first (the costliest parameter
    to the least-loaded rank; ties to the lower rank). ``loads``: each rank's cost so far,
    updated (to balance several calls, e.g. stage 3's units one by one)."""
    loads = loads if loads is not None else [0] * world_size
    owned: list[list[NamedParam]] = [[] for _ in range(world_size)]
    for m in sorted(params, key=lambda m: -cost(m.true_shape)):
        r = min(range(world_size), key=lambda i: (loads[i], i))
        owned[r].append(m)
        loads[r] += cost(m.true_shape)
    return owned


def owner_layout(index: int, slots: Sequence[Sequence[NamedParam]], world_size: int) -> tuple[UnitLayout,
                                                                                            list[NamedParam]]:
    """One unit whose slot r holds ``slots[r]`` whole (Note [whole-tensor units])."""
    width = max([sum(m.flat_numel + m.param.dtype.is_complex for m in slot) for slot in slots] + [1])  # (+1: alignment)
    width = -(-width // ALIGN_ELEMENTS) * ALIGN_ELEMENTS
    segments, members = [], []
    for r, slot in enumerate(slots):
        offset = r * width
        for m in sorted(slot, key=lambda m: m.group):
            segments.append(_segment(m, offset))
            members.append(m)
            offset = segments[-1].end
    return UnitLayout(index, tuple(segments), width * world_size, world_size), members


def owner_layouts(params: Sequence[NamedParam], world_size: int, bucket_numel: int, first_index: int = 0
                  ) -> list[tuple[UnitLayout, list[NamedParam]]]:
    """Units of whole parameters, each in one rank's slot (Note [whole-tensor units]): owners
    balanced by cost, each rank's list by size, zipped into units of about ``bucket_numel``."""
    queues = [sorted(p, key=lambda m: -m.true_shape.numel()) for p in assign_owners(params, world_size)]
    out: list[tuple[UnitLayout, list[NamedParam]]] = []
    while any(queues):
        slots: list[list[NamedParam]] = [[] for _ in range(world_size)]
        for r, q in enumerate(queues):  # (each slot up to the bucket's share, at least one parameter)
            while q and (not slots[r] or sum(m.true_shape.numel() for m in slots[r]) + q[0].true_shape.numel()
                         <= max(1, bucket_numel // world_size)):
                slots[r].append(q.pop(0))
        out.append(owner_layout(first_index + len(out), slots, world_size))
    return out


def layouts_with_owners(units: Sequence[Sequence[NamedParam]], world_size: int, whole_groups: frozenset[int],
                        first_index: int = 0) -> list[tuple[UnitLayout, list[NamedParam]]]:
    """``layouts_for`` where a unit that holds a parameter of a whole-tensor group gets an owner
    layout of all its parameters (stage 3's units follow modules: Note [whole-tensor units]);
    owners balanced over all such units together."""
    loads = [0] * world_size
    out = []
    for i, members in enumerate(units):
        if any(m.group in whole_groups for m in members):
            out.append(owner_layout(first_index + i, assign_owners(members, world_size, loads=loads), world_size))
        else:
            out.extend(layouts_for([members], world_size, first_index + i))
    return out
