"""Reading a range of one layout's tensor out of a checkpoint written at another TP layout.

Note [stored order]: a TP-sharded tensor (Note [tensor-parallel parameters] in
``zeroshard/comm/tensor_parallel.py``) is stored as its tp chunks back to back, each
flattened: with ``split = {"dim": d, "sizes": [s_0, s_1, ...]}`` chunk k is the global
tensor narrowed to ``[s_0 + ... + s_{k-1}, + s_k)`` along dim d. Pieces tile that stored order
as they tile any tensor (so validation and the per-rank files do not change). For d = 0 the
stored order is the global row-major order; for d > 0 it is a permutation of it.

A reader wants elements ``[a, b)`` of *its* view of the tensor: the whole tensor, or its own
tp chunk under a split of its own. Same split as saved: one stored range. Otherwise it reads
the dim-0 rows its range touches — from every saved chunk, the rows' contiguous stored range
(whole dim-0 rows of the outer dimensions) — puts them together as global rows, narrows to
its chunk and cuts ``[a, b)``. It reads at most one dim-0 row more per end than it needs.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from zeroshard.comm.tensor_parallel import Split

Target = Optional[tuple[Split, int]]
"""What a reader holds: None (the whole tensor) or (split, its chunk)."""


def _prod(xs: Sequence[int]) -> int:
    n = 1
    for x in xs:
        n *= x
    return n


def split_of(meta: dict) -> Optional[Split]:
    """A manifest entry's split (None: stored in global order)."""
    s = meta.get("split")
    return None if s is None else Split(int(s["dim"]), tuple(int(x) for x in s["sizes"]))


def global_order(saved: Optional[Split]) -> bool:
    """The stored order of a tensor saved with split ``saved`` is its global row-major order
    (no split, or dim-0 chunks back to back): a whole-tensor reader's range ``[a, b)`` is the
    stored range ``[a, b)``."""
    return saved is None or saved.dim == 0


def _local_shape(shape: tuple[int, ...], target: Target) -> tuple[int, ...]:
    if target is None:
        return shape
    split, k = target
    return tuple(split.sizes[k] if i == split.dim else d for i, d in enumerate(shape))


def plan(shape: Sequence[int], saved: Optional[Split], target: Target, a: int, b: int
         ) -> tuple[list[tuple[int, int]], Callable[[list[torch.Tensor]], torch.Tensor]]:
    """The stored ranges holding elements ``[a, b)`` of ``target``'s view, and how to build
    those elements (1-D) from the ranges' values (in the order given)."""
    shape = tuple(shape)
    if saved is not None and saved.dim == 0 and saved.sizes and target is None:
        saved = None  # (dim-0 chunks back to back are the global order)
    if target is not None and saved is not None and target[0] == saved:  # the layout that wrote it
        off = saved.stored_offset(shape, target[1])
        return [(off + a, off + b)], lambda parts: parts[0]
    if saved is None and (target is None or target[0].dim == 0):
        off = 0 if target is None else target[0].stored_offset(shape, target[1])
        return [(off + a, off + b)], lambda parts: parts[0]
    local = _local_shape(shape, target)
    if a >= b:
        return [], lambda parts: torch.empty(0)
    inner = _prod(local[1:])
    r0, r1 = a // inner, (b - 1) // inner + 1  # the local dim-0 rows [r0, r1) touched
    g0, g1 = r0, r1
    if target is not None and target[0].dim == 0:
        g0, g1 = r0 + target[0].dim_offset(target[1]), r1 + target[0].dim_offset(target[1])
    if saved is None or saved.dim == 0:  # global rows [g0, g1) are one stored range
        ginner = _prod(shape[1:])
        ranges = [(g0 * ginner, g1 * ginner)]

        def rows(parts: list[torch.Tensor]) -> torch.Tensor:
            return parts[0].view(g1 - g0, *shape[1:])
    else:
        d = saved.dim
        per_row = _prod(shape[1:d])  # outer indices (dims before d) per dim-0 row
        o0, o1, tail = g0 * per_row, g1 * per_row, _prod(shape[d + 1:])
        ranges = [(saved.stored_offset(shape, k) + o0 * s * tail, saved.stored_offset(shape, k) + o1 * s * tail)
                  for k, s in enumerate(saved.sizes)]

        def rows(parts: list[torch.Tensor]) -> torch.Tensor:
            chunks = [p.view(o1 - o0, s, tail) for p, s in zip(parts, saved.sizes)]
            return torch.cat(chunks, dim=1).view(g1 - g0, *shape[1:])

    def build(parts: list[torch.Tensor]) -> torch.Tensor:
        slab = rows(parts)
        if target is not None and target[0].dim > 0:
            split, k = target
            slab = slab.narrow(split.dim, split.dim_offset(k), split.sizes[k])
        return slab.reshape(-1)[a - r0 * inner:b - r0 * inner]
    return ranges, build
