"""Parameters that got no gradient on any rank are left alone by a step, as torch.optim leaves
a parameter whose ``.grad`` is None (DDP gives such a parameter no gradient either).

Runs are one per parameter's piece (Note [one run per parameter] in kernel_choice.py), so a
run none of whose parameters got a gradient is not stepped at all (``skip_whole_runs``), step
count included, as torch.optim. Under NVMe streaming a run spans a unit's group; the untouched
parameters of a run that is stepped keep their values and moments (``partly_untouched``: the stream
puts them back after the kernel, Note [untouched parts of a streamed run] in
zeroshard/offload/nvme_state.py), and only the run's one step count moves on. A
parameter unused on only some ranks did get a gradient (the others' average with zeros),
exactly as with DDP.

The global view costs one small all-reduce per step (a byte per parameter) at world > 1.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from zeroshard.units.run import Run

if TYPE_CHECKING:
    from zeroshard.comm.process_group import Comm
    from zeroshard.units.flat_unit import FlatUnit


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
    parameter whose ``.grad`` is None, their step count included. Returns the function that
    gives the gradients back."""
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


def partly_untouched(units: Sequence[FlatUnit], runs: Sequence[Run], untouched: set[tuple[int, int]]
                     ) -> dict[int, list[tuple[int, int]]]:
    """Runs some but not all of whose parameters are untouched, by ``id`` of the run's tensor: the
    element ranges of the untouched ones within the run (the NVMe stream steps the run whole and puts
    them back)."""
    out: dict[int, list[tuple[int, int]]] = {}
    if not untouched:
        return out
    for run, pieces, quiet in _untouched_pieces(units, runs, untouched):
        if quiet and len(quiet) < len(pieces):
            out[id(run.tensor)] = [(p.unit_offset - run.a, p.unit_offset - run.a + p.numel) for p in quiet]
    return out
