"""A run: one tensor of the inner optimizer, and how state lines up with it.

The inner torch optimizer never sees the model's parameters: it steps one tensor per unit and
param group, the rank's owned range ``[a, b)`` of that unit (a *run*). Everything that moves
optimizer state (state dicts, checkpoints, NVMe swapping, reports) reads it through runs, so
the run and the rules for slicing its state sit at the bottom with the unit.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from zeroshard.layout import Piece
from zeroshard.units.flat_unit import FlatUnit


@dataclass(frozen=True)
class Run:
    """One tensor of the inner optimizer: unit range ``[a, b)`` of param group ``group``."""

    unit: FlatUnit
    group: int
    a: int
    b: int
    tensor: torch.Tensor


def elementwise_state(value: Any, run_tensor: torch.Tensor) -> bool:
    """A state tensor with one value per element of the run (sliced with it, like Adam's
    moments). Anything else (``step``, or a custom optimizer's per-tensor state of shape
    (1,)) is one value per run and is saved and loaded whole, as a scalar."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == run_tensor.shape


def flat(t: torch.Tensor) -> torch.Tensor:
    """A run's tensor, or its elementwise state, as the flat unit range it covers (a
    whole-tensor run holds its parameter's shape: Note [whole-tensor units])."""
    return t.reshape(-1)


def run_pieces(run: Run) -> Iterator[Piece]:
    """The parameters' pieces the run covers, in unit order."""
    yield from run.unit.layout.pieces_in(run.a, run.b)
