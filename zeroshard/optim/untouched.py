"""Parameters that got no gradient on any rank are left alone by a step, as torch.optim leaves
a parameter whose ``.grad`` is None (DDP gives such a parameter no gradient either).

The inner optimizer updates whole runs (one tensor per unit and group), so it cannot skip
one parameter inside a run; instead the step saves the values and elementwise state of the
untouched parameters' pieces and puts them back afterwards. A parameter unused on only some
ranks did get a gradient (the others' average with zeros), exactly as with DDP. A run none of
whose parameters got a gradient is not stepped at all (``skip_whole_runs``), step count
included. What cannot be kept per parameter in a run that is stepped: its scalar state
(Adam's ``step``) counts the steps of the run.

The global view costs one small all-reduce per step (a byte per parameter) at world > 1.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from zeroshard.optim.state_io import Run, elementwise_state, flat

if TYPE_CHECKING:
    from zeroshard.comm.process_group import Comm
    from zeroshard.optim.flat_unit import FlatUnit


def untouched_everywhere(flags: Sequence[Sequence[bool]], comm: Comm, replicas: Optional[Comm],
                         units: Sequence[FlatUnit]) -> set[tuple[int, int]]:
    """(unit index, segment index) of parameters no rank saw a gradient for since zero_grad:
    ``flags`` are this rank's (the reducer's ``touched``), agreed over ``comm`` and ``replicas``
    in a tensor where the ``units``' gradients are (where the collectives run)."""
    flat = [f for unit_flags in flags for f in unit_flags]
    if all(flat):
        if comm.world_size == 1:
            return set()
    t = torch.tensor(flat, dtype=torch.uint8, device=units[0].grad_store.device)
    comm.all_reduce(t, op=dist.ReduceOp.MAX, what="grad_flags")
    if replicas is not None:  # hybrid: another replica's gradient reached this one too
        replicas.all_reduce(t, op=dist.ReduceOp.MAX, what="grad_flags")
    seen = t.tolist()
    out, i = set(), 0
    for ui, unit_flags in enumerate(flags):
        for si in range(len(unit_flags)):
            if not seen[i]:
                out.add((ui, si))
            i += 1
    return out


def _untouched_pieces(units: Sequence[FlatUnit], runs: Sequence[Run], untouched: set[tuple[int, int]]
                      ) -> Iterator[tuple[Run, list, list]]:
    """Per run: its non-empty pieces, and those of them whose parameter is untouched."""
    index = {id(u): ui for ui, u in enumerate(units)}
    for run in runs:
        ui = index[id(run.unit)]
        # (by segment, not offset: a zero-element parameter starts where the next one does)
        seg_index = {id(seg): si for si, seg in enumerate(run.unit.layout.segments)}
        pieces = [p for p in run.unit.layout.pieces_in(run.a, run.b) if p.numel]
        yield run, pieces, [p for p in pieces if (ui, seg_index[id(p.segment)]) in untouched]


def skip_whole_runs(units: Sequence[FlatUnit], runs: Sequence[Run], untouched: set[tuple[int, int]]
                    ) -> Callable[[], None]:
    """Runs all of whose parameters are untouched are left out of the step: their ``.grad`` is
    hidden, so the inner optimizer (and the NVMe step) skips them as torch.optim skips a
    parameter whose ``.grad`` is None, their step count included. (A run some of whose
    parameters got a gradient is stepped, and ``freeze`` puts the others back.) Returns the
    function that gives the gradients back."""
    if not untouched:
        return lambda: None
    hidden: list[tuple[torch.Tensor, torch.Tensor]] = []
    for run, pieces, quiet in _untouched_pieces(units, runs, untouched):
        if run.tensor.grad is not None and pieces and len(quiet) == len(pieces):
            hidden.append((run.tensor, run.tensor.grad))
            run.tensor.grad = None

    def give_back() -> None:
        for t, g in hidden:
            t.grad = g
    return give_back


def freeze(units: Sequence[FlatUnit], runs: Sequence[Run], states: Mapping[torch.Tensor, dict],
           untouched: set[tuple[int, int]]) -> Callable[[], None]:
    """Saves the untouched pieces of the runs the step updates (after ``skip_whole_runs``, those
    with a gradient) and their elementwise state (``states``: the inner optimizer's); the
    returned function restores them after the step."""
    if not untouched:
        return lambda: None
    saved: list[tuple[Any, int, int, torch.Tensor, dict[str, torch.Tensor]]] = []
    for run, _, quiet in _untouched_pieces(units, runs, untouched):
        if run.tensor.grad is None:  # (not stepped: nothing to put back)
            continue
        state = states.get(run.tensor, {})
        for piece in quiet:
            lo = piece.unit_offset - run.a
            hi = lo + piece.numel
            moments = {k: flat(v)[lo:hi].clone() for k, v in state.items() if elementwise_state(v, run.tensor)}
            saved.append((run, lo, hi, flat(run.tensor)[lo:hi].clone(), moments))

    def restore() -> None:
        units = {}
        for run, lo, hi, values, moments in saved:
            flat(run.tensor)[lo:hi].copy_(values)
            state = states.get(run.tensor, {})
            for k, v in moments.items():
                if k in state:
                    flat(state[k])[lo:hi].copy_(v)
            units[id(run.unit)] = run.unit
        for unit in units.values():  # the model-dtype copy was written from the master already
            unit.write_back()
    return restore
