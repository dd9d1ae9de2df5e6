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
from typing import Iterator

import torch


@dataclass(frozen=True)
class Segment:
    """One parameter's place in its unit."""

    name: str
    shape: torch.Size
    offset: int
    numel: int
    group: int

    @property
    def end(self) -> int:
        return self.offset + self.numel


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
