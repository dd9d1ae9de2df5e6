"""The gradients of one ZeroOptimizer between backward and step, as torch code sees them.

Lifecycle: built once by the assembly over the reducer (which moves each gradient into its
unit's store as backward runs: grads/reducer.py) and the ``.grad`` views (grads/links.py). Each
backward pass starts with ``begin_pass`` (what torch code did to ``.grad`` goes into the
stores first); the step, clipping and ``zero_grad`` start with ``finalize``, which completes
the reductions and takes in ``.grad`` again; ``zero_grad`` clears as torch does.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from zeroshard.comm.process_group import Comm
from zeroshard.ops.sqnorm import squared_norm_f64
from zeroshard.grads import norm as grad_norm
from zeroshard.units.flat_unit import FlatUnit
from zeroshard.grads.links import GradLinks
from zeroshard.grads.reducer import GradientReducer
from zeroshard.units.step_in_flight import StepInFlight
from zeroshard.precision.precision_policy import Precision


class GradientFlow:
    def __init__(self, units: Sequence[FlatUnit], reducer: GradientReducer, links: GradLinks,
                 visible: Callable[[torch.Tensor], torch.Tensor], precision: Precision, comm: Comm,
                 data_parallel_size: int, inflight: StepInFlight) -> None:
        self.units = list(units)
        self.reducer = reducer
        self.links = links
        self.visible = visible
        self.precision = precision
        self.comm = comm
        self.data_parallel_size = data_parallel_size
        self.inflight = inflight
        self.set_grad_factor()

    def set_grad_factor(self) -> None:
        # Gradients are averaged over ranks and unscaled as each reduction retires.
        self.reducer.grad_factor = self.precision.grad_factor(self.data_parallel_size)

    def begin_pass(self) -> None:
        """A backward pass starts: what torch code did to ``.grad`` goes into the stores, then
        ``.grad`` is detached so autograd accumulates this pass's gradients afresh."""
        self.inflight.join()
        self.note_assigned()
        self.links.reconcile()
        self.links.detach_all()

    def note_assigned(self) -> None:
        """A ``.grad`` that torch code assigned (not the published view) is a gradient too."""
        for ui, unit in enumerate(self.units):
            for si, m in enumerate(unit.members):
                p = self.visible(m.param)  # the parameter torch code holds
                if p.grad is not None and p.grad is not self.links.published(p):
                    self.reducer.mark_touched(ui, si)

    def owned_grads(self) -> list[torch.Tensor]:
        return [u.owned_grad() for u in self.units if u.grad_valid]

    def finalize(self) -> bool:
        """Completes reductions and takes in what torch code did to ``.grad``; returns True
        when the step must be skipped (fp16 overflow)."""
        self.reducer.finalize()
        self.note_assigned()
        self.links.reconcile()

        def local_overflow() -> bool:  # (FlatUnit.note_grad_stats notes the same test for swapped gradients)
            return any(grad_norm.map_owned_grads(self.units, lambda g: not bool(torch.isfinite(squared_norm_f64(g))),
                                                 cached=lambda s: not s["finite"]))
        return self.precision.overflow(self.reducer.passes, self.reducer.grads_since_clear, local_overflow, self.comm)

    def zero_grad(self, set_to_none: bool, param_groups: Sequence[dict]) -> None:
        """As torch.optim's ``zero_grad`` over ``param_groups`` (those torch code sees)."""
        self.reducer.finalize()  # every rank must finish the collectives it started
        had = {id(p) for group in param_groups for p in group["params"] if p.grad is not None}
        units = self.units

        def clear_all() -> None:
            for u in units:
                u.clear_grads(True)
        # (a step in flight still reads the stores: they are marked empty once it is joined)
        if not (set_to_none and self.inflight.defer(clear_all)):
            self.inflight.join()
            for unit in units:
                unit.clear_grads(set_to_none)
        for group in param_groups:
            for p in group["params"]:
                p.grad = None
        self.reducer.clear_touched()
        if not set_to_none:  # as torch: gradients that existed are now zeros (and are stepped)
            for ui, unit in enumerate(units):
                for si, m in enumerate(unit.members):
                    if id(m.param) in had:
                        self.reducer.mark_touched(ui, si)
            self.links.publish(only=had)
        else:
            self.links.detach_all()
        self.reducer.grads_since_clear = False
