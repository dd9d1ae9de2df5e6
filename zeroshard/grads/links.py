"""``GradLinks``: ``param.grad`` as torch code expects it, backed by zeroshard's gradient stores.

Note [visible gradients]: gradients are reduced into each unit's fp32 gradient store during
backward (zeroshard/grads/reducer.py). Once a backward pass has finished, every trainable
parameter's ``.grad`` is *published* as a view of its range of that store:

- stages 0-1, fp32 model, store in memory on the model's device: a plain tensor view of the
  whole averaged gradient (no extra memory; identical on every rank);
- otherwise a ``ShardedTensor`` (zeroshard/stages/sharded_tensor.py): this rank's piece at stages
  2-3, or the whole fp32 gradient behind a bf16/fp16 parameter or a swap file.

Torch code may then read, scale, clip or unscale ``p.grad`` in place (it writes the store),
replace it, or set it to None. What it left is *reconciled* into the stores before they are
used again (the next backward, ``step``, ``clip_grad_norm_``), with torch's meaning:

- still the published tensor: nothing to do (in-place changes are already in the store);
- None (``model.zero_grad()``, the Hugging Face Trainer's way): that parameter's gradient is
  gone, so the next backward starts it from zero and a step with no gradient at all is skipped;
- another tensor: its values become the gradient.

At the start of each backward pass every ``p.grad`` is detached (set to None) before autograd
accumulates into it, so autograd never adds a local, unreduced gradient into an averaged
store; accumulation across micro-batches happens in the stores (grads/reducer.py).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional, Sequence

import torch

from zeroshard.comm.tensor_parallel import as_param_grad, local_grad
from zeroshard.comm.process_group import Comm
from zeroshard.layout import Segment, as_real, real_dtype
from zeroshard.units.flat_unit import FlatUnit
from zeroshard.stages.sharded_tensor import ShardedTensor


class GradLinks:
    def __init__(self, units: Sequence[FlatUnit], comm: Comm,
                 visible: Callable[[torch.Tensor], torch.Tensor] = lambda p: p) -> None:
        self.units = list(units)
        self.comm = comm
        # .grad is published on the parameter torch code holds: at stage 3 the sharded one
        # (Note [sharded parameters] in zeroshard/stages/stage3/gatherer.py).
        self.entries = [(u, seg, visible(m.param)) for u in self.units for m, seg in zip(u.members, u.layout.segments)]
        self._published: dict[int, torch.Tensor] = {}

    # -- publishing ---------------------------------------------------------------------------
    def view(self, unit: FlatUnit, seg: Segment, param: torch.Tensor) -> torch.Tensor:
        """The tensor that stands for ``param``'s gradient in ``unit``'s store."""
        store = unit.grad_store
        w = 2 if seg.complex_dtype is not None else 1  # (reals per element: Note [complex parameters])
        if not unit.policy.shard_gradients:
            if not unit.swap and store.dtype == real_dtype(param.dtype) and store.device == param.device:
                return seg.bind(store[seg.offset:seg.end])
            return ShardedTensor(store, seg.offset, seg.numel // w, seg.param_shape, param.dtype, param.device, 0,
                                 None, unit)
        lo, hi = unit.owned
        a, b = max(lo, seg.offset), min(hi, seg.end)
        comm = self.comm if self.comm.world_size > 1 else None
        return ShardedTensor(store, a - unit.grad_base if a < b else 0, max(0, b - a) // w, seg.param_shape,
                             param.dtype, param.device, max(0, a - seg.offset) // w, comm, unit)

    def published(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        """The view last published as ``p.grad`` (None when none is)."""
        return self._published.get(id(p))

    def publish(self, only: Optional[set[int]] = None) -> None:
        """Every parameter of a unit holding a gradient gets its view as ``.grad``; others None.
        ``only``: publish just these parameters (by id), leave the rest None."""
        self._published.clear()
        for unit, seg, p in self.entries:
            if unit.grad_valid and (only is None or id(p) in only):
                t = as_param_grad(p, self.view(unit, seg, p))
                p.grad = t
                self._published[id(p)] = t
            else:
                p.grad = None

    def detach_all(self) -> None:
        for _, _, p in self.entries:
            p.grad = None
        self._published.clear()

    # -- reconciling what torch code did --------------------------------------------------------
    def reconcile(self) -> None:
        """Folds what torch code did to ``.grad`` since publishing into the stores."""
        by_unit: dict[int, tuple[FlatUnit, list, list]] = {}
        for unit, seg, p in self.entries:
            g, pub = p.grad, self._published.get(id(p))
            if g is pub:
                continue
            cleared, replaced = by_unit.setdefault(id(unit), (unit, [], []))[1:]
            if g is None:
                cleared.append((seg, p))
            else:
                replaced.append((seg, p, local_grad(p, g)))
        for unit, cleared, replaced in by_unit.values():
            self._reconcile_unit(unit, cleared, replaced)
            for _, p in cleared:
                self._published.pop(id(p), None)
            for seg, p, _ in replaced:  # linked again: later in-place changes reach the store
                t = as_param_grad(p, self.view(unit, seg, p))
                p.grad = t
                self._published[id(p)] = t

    def _reconcile_unit(self, unit: FlatUnit, cleared: list, replaced: list) -> None:
        if not unit.grad_valid and not replaced:
            return
        if not replaced and len(cleared) == len(unit.layout.segments):
            unit.grad_valid = False  # every gradient of the unit was set to None
            return
        swap = unit.swap if unit.swapped("grad") else None
        with swap.resident(unit, ("grad",), write=True) if swap else contextlib.nullcontext():
            if not unit.grad_valid:  # a tensor assigned where there was no gradient
                unit.grad_store.zero_()
                unit.grad_valid = True
            for seg, _ in cleared:
                self._range(unit, seg).zero_()
            for seg, p, g in replaced:
                _check_assigned(seg, p, g)
                dst = self._range(unit, seg)
                dst.copy_(_piece(g, seg, unit, dst.numel()))
            if swap is not None:
                unit.note_grad_stats()

    @staticmethod
    def _range(unit: FlatUnit, seg: Segment) -> torch.Tensor:
        """This rank's part of ``seg`` in the store (the whole segment at stages 0-1)."""
        if not unit.policy.shard_gradients:
            return unit.grad_store[seg.offset:seg.end]
        lo, hi = unit.owned
        a, b = max(lo, seg.offset), min(hi, seg.end)
        return unit.grad_range(a, b) if a < b else unit.grad_store[:0]


def _piece(g: torch.Tensor, seg: Segment, unit: FlatUnit, n: int) -> torch.Tensor:
    """The values of an assigned gradient ``g`` for this rank's part of ``seg`` (``n`` elements)."""
    start = max(unit.owned[0], seg.offset) - seg.offset if unit.policy.shard_gradients else 0
    w = 2 if seg.complex_dtype is not None else 1  # (g counts complex elements: Note [complex parameters])
    if isinstance(g, ShardedTensor):
        if g.sharded and g.n * w == n and g.start * w == start:
            return as_real(g.local).reshape(-1)
        g = g.full() if g.sharded else g.local.view(g.shape)
    return as_real(g.detach()).reshape(-1)[start:start + n]


def _check_assigned(seg: Segment, p: torch.Tensor, g: torch.Tensor) -> None:
    if tuple(g.shape) != tuple(seg.param_shape):
        raise RuntimeError(f"{seg.name}.grad was set to a tensor of shape {tuple(g.shape)}; the parameter "
                           f"has shape {tuple(seg.param_shape)}")
    if g.is_sparse:
        raise RuntimeError(f"{seg.name}.grad was set to a sparse tensor; zeroshard keeps dense gradients")
