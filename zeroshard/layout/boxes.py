"""A flat range of a tensor as the rectangular chunks (boxes) torch's DCP describes it by."""
from __future__ import annotations

import math

Box = tuple[tuple[int, ...], tuple[int, ...], int, int]
"""(offsets, sizes, flat start, flat stop) of one chunk."""


def boxes(shape: tuple[int, ...], a: int, b: int) -> list[Box]:
    """The row-major flat range ``[a, b)`` of a tensor of ``shape`` as boxes (chunks): whole rows
    where it can, a partial row split along the next dimension. Each box is a contiguous run of
    the range, so its data is a slice of the flat piece."""
    if a >= b:
        return []
    if len(shape) <= 1:
        return [((a,) if shape else (), (b - a,) if shape else (), a, b)]
    row = math.prod(shape[1:])
    out: list[Box] = []
    while a < b:
        r, off = divmod(a, row)
        if off == 0 and b - a >= row:
            n = (b - a) // row
            out.append(((r,) + (0,) * (len(shape) - 1), (n,) + tuple(shape[1:]), a, a + n * row))
            a += n * row
        else:
            end = min(b, (r + 1) * row)
            out += [((r,) + o, (1,) + s, lo + r * row, hi + r * row) for o, s, lo, hi in boxes(shape[1:], off, end - r * row)]
            a = end
    return out
