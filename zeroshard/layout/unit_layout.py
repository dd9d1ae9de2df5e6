"""The geometry of a flat unit: segments, padding, per-rank slices and pieces.

Pure bookkeeping with no tensors, so that the optimizer, the checkpoint writer and the
resharding loader all derive ranges from the same arithmetic. See DESIGN.md, "Flat units".

A unit's parameters are laid out back to back in one 1-D buffer, grouped so that the
parameters of one optimizer param group are contiguous (a rank's slice then meets each
group in at most one run, so the inner optimizer sees one tensor per unit and group).
The buffer is padded to a multiple of ``world_size * align`` so it splits into
``world_size`` equal, aligned slices; rank r owns slice r. A *piece* is the intersection
of one parameter's segment with a slice, expressed in the parameter's own flat indices:
that is the key a checkpoint stores, independent of rank and world size.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterator, Optional

import torch


def real_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a flat buffer holds a parameter of ``dtype`` in: a complex parameter's real
    and imaginary parts (Note [complex parameters])."""
    return dtype.to_real() if dtype.is_complex else dtype


def as_real(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the reals a flat buffer holds (a complex tensor as ``(*shape, 2)``)."""
    return torch.view_as_real(t) if t.is_complex() else t


# Note [complex parameters]: flat buffers stay real. A complex parameter is a segment of
# 2 * numel reals, shaped ``(*shape, 2)`` (``torch.view_as_real`` of it) and placed at an even
# unit offset: slices are multiples of ``ALIGN_ELEMENTS`` (even), so every piece of it is whole
# complex numbers at an even offset, and ``torch.view_as_complex`` (which refuses odd storage
# offsets) binds the parameter, its gradient and its pieces to the buffers. The inner optimizer
# then steps the real view, which is what torch.optim does with complex parameters; pieces on
# disk are reals, the manifest records the complex dtype; ``state_dict()`` shows moments as
# complex tensors of the parameter's shape, as torch's. Mixed precision is refused for them.
@dataclass(frozen=True)
class Segment:
    """One parameter's place in its unit (``shape``/``numel``: of the reals the buffer holds;
    ``complex_dtype``: the parameter's dtype when it is complex, Note [complex parameters])."""

    name: str
    shape: torch.Size
    offset: int
    numel: int
    group: int
    complex_dtype: Optional[torch.dtype] = None

    @property
    def end(self) -> int:
        return self.offset + self.numel

    @property
    def param_shape(self) -> torch.Size:
        """The parameter's own shape (``shape`` less the trailing 2 of a complex one)."""
        return self.shape[:-1] if self.complex_dtype is not None else self.shape

    def bind(self, flat: torch.Tensor) -> torch.Tensor:
        """The parameter-shaped view of its range ``flat`` of a unit buffer (complex for a
        complex parameter: Note [complex parameters])."""
        t = flat.view(self.shape)
        return torch.view_as_complex(t) if self.complex_dtype is not None else t


@dataclass(frozen=True)
class Piece:
    """The part ``[start, stop)`` (in the parameter's flat indices) of segment ``segment``
    that lies in a slice; ``unit_offset`` is where ``start`` sits in the unit buffer."""

    segment: Segment
    start: int
    stop: int

    @property
    def unit_offset(self) -> int:
        return self.segment.offset + self.start

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class UnitLayout:
    index: int
    segments: tuple[Segment, ...]
    padded_numel: int
    world_size: int

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.segments)

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    @functools.cached_property
    def padding(self) -> tuple[tuple[int, int], ...]:
        """The unit ranges no segment covers (the tail, and between segments in an owner
        layout: Note [whole-tensor units] in bucketing.py); computed once (the reducer reads
        it at every launch)."""
        out, at = [], 0
        for seg in sorted(self.segments, key=lambda s: s.offset):
            if seg.offset > at:
                out.append((at, seg.offset))
            at = max(at, seg.end)
        if at < self.padded_numel:
            out.append((at, self.padded_numel))
        return tuple(out)

    def slice_of(self, rank: int) -> tuple[int, int]:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is outside world_size={self.world_size}")
        n = self.shard_numel
        return rank * n, (rank + 1) * n

    def pieces_in(self, lo: int, hi: int) -> Iterator[Piece]:
        """Pieces of every segment that meet the unit range ``[lo, hi)``."""
        for seg in self.segments:
            a, b = max(lo, seg.offset), min(hi, seg.end)
            if a < b:
                yield Piece(seg, a - seg.offset, b - seg.offset)

    def group_runs(self, lo: int, hi: int) -> Iterator[tuple[int, int, int]]:
        """``(group, start, stop)`` unit ranges inside ``[lo, hi)``, one per param group
        (segments of a group are contiguous by construction)."""
        runs: dict[int, list[int]] = {}
        for piece in self.pieces_in(lo, hi):
            g = piece.segment.group
            a, b = piece.unit_offset, piece.unit_offset + piece.numel
            if g in runs:
                runs[g][1] = b
            else:
                runs[g] = [a, b]
        for g, (a, b) in runs.items():
            yield g, a, b
