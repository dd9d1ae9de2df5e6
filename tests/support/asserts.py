"""Tensor comparisons that say which tensor differed.

``assert all(torch.equal(a[k], b[k]) for k in a)`` fails with ``assert False``; these fail with
the key (or index) path of every differing tensor, the first one's shapes, dtypes, largest
absolute difference and how many elements differ.

Both walk ``want``: a mapping key by key (a key missing from ``got`` is a failure; keys only in
``got`` are not looked at, as ``for k in want`` did), nested mappings and sequences recursively,
other sequences pairwise as ``zip`` pairs them. Leaves that are not tensors (numbers, lists of
numbers from JSON) go through ``torch.as_tensor``.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

_SHOWN = 5  # differing keys listed by name in a message


def assert_same(got: Any, want: Any, what: str = "tensors") -> None:
    """Every tensor of ``want`` equals its counterpart in ``got`` bit for bit (``torch.equal``)."""
    _compare(got, want, what, torch.equal, "bitwise")


def assert_close_named(got: Any, want: Any, what: str = "tensors", *, rtol: float = 1e-5,
                       atol: float = 1e-8) -> None:
    """Every tensor of ``want`` is ``torch.allclose(got, want, rtol, atol)`` to its counterpart."""
    _compare(got, want, what, lambda g, w: torch.allclose(g, w, rtol=rtol, atol=atol),
             f"within rtol={rtol:g}, atol={atol:g}")


def _compare(got: Any, want: Any, what: str, same: Callable[[torch.Tensor, torch.Tensor], bool],
             how: str) -> None:
    bad: list[tuple[str, str]] = []
    for path, g, w in _pairs(got, want, ""):
        if g is _MISSING:
            bad.append((path, "missing from got"))
            continue
        g, w = _tensor(g), _tensor(w)
        if not same(g, w):
            bad.append((path, _difference(g, w)))
    if bad:
        names = ", ".join(p or "<top>" for p, _ in bad[:_SHOWN]) + (f" and {len(bad) - _SHOWN} more"
                                                                      if len(bad) > _SHOWN else "")
        first, detail = bad[0]
        raise AssertionError(f"{what}: {len(bad)} tensor(s) not equal ({how}): {names}; "
                             f"first, {first or '<top>'}: {detail}")


_MISSING = object()


def _pairs(got: Any, want: Any, path: str) -> Iterator[tuple[str, Any, Any]]:
    if isinstance(want, Mapping):
        for k in want:
            sub = f"{path}[{k!r}]"
            if got is _MISSING or k not in got:
                yield sub, _MISSING, want[k]
            else:
                yield from _pairs(got[k], want[k], sub)
    elif _is_sequence(want) and _is_sequence(got) and not _is_leaf_list(want):
        for i, (g, w) in enumerate(zip(got, want)):
            yield from _pairs(g, w, f"{path}[{i}]")
    else:
        yield path, got, want


def _is_sequence(x: Any) -> bool:
    return isinstance(x, Iterable) and not isinstance(x, (torch.Tensor, str, bytes, Mapping))


def _is_leaf_list(x: Any) -> bool:
    """A (nested) list of numbers, a tensor written as JSON, is one value, not a sequence of tensors."""
    if not isinstance(x, (list, tuple)):
        return False
    while isinstance(x, (list, tuple)) and x:
        x = x[0]
    return isinstance(x, (int, float, bool, list, tuple))


def _tensor(x: Any) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(x)


def _difference(g: torch.Tensor, w: torch.Tensor) -> str:
    head = f"got {tuple(g.shape)} {g.dtype}, want {tuple(w.shape)} {w.dtype}"
    if g.shape != w.shape:
        return head + " (shapes differ)"
    try:
        gd, wd = g.detach().cpu().double(), w.detach().cpu().double()
        diff = (gd - wd).abs()
        differ = int((gd != wd).sum()) - int((gd.isnan() & wd.isnan()).sum())
        worst = diff.nan_to_num(nan=float("inf")).max().item() if diff.numel() else 0.0
        return head + f", max |got - want| = {worst:.3g}, {differ} of {g.numel()} elements differ"
    except (RuntimeError, TypeError) as e:  # (a dtype double() cannot take)
        return head + f" (no difference computed: {e})"
