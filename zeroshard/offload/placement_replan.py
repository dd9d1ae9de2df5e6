"""``offload="auto"`` with the micro-batch's shape measured at the first forward: the state's placement
chosen again there together with the activations, and the state moved to it before the first block
runs (Note [state re-placed at the first forward]).

Note [state re-placed at the first forward]: with a declared shape (``PlannedActivations(micro_batch=,
seq_len=)``) the state's placement and the activations are planned together at construction (Note
[joint state and activation plan] in zeroshard/planner/joint_plan.py). Measured, the shape is known
only at the first forward's first block, after the state was placed (state first). There, before any
block runs, the same joint search runs over the same candidates (the construction plan among them, as
its first), and where it picks another placement the state moves to it. The gradients have no value
yet (the first backward writes them: a gradient leaving the swap file is allocated, not read, and one
arriving is only given a region), so moving means giving the units' swap file the other parts the new
plan streams (``NvmeUnitStore.re_adopt``: written to a region at the file's end, then released) or
taking them back (read), and moving the moments of the runs whose tier changes
(``NvmeOptimizerState.re_place``: a run leaving memory is written to a region at the file's end, one
coming back read into a new buffer, the others stay). Before the first step there are no moments
(``NvmeOptimizerState`` starts them at zero) unless a checkpoint was loaded before the first forward:
then they move with their values. The run then holds what a run with the shape declared holds (same
parts swapped, same moments resident, same kernel over the same runs, the same values), so its bits
are the same. The file, scratch, keeps the regions given up.

For that the structure the joint plan may need is built at construction whenever a re-placement is
possible (``re_place_blocker`` is None): the units' swap file (empty while the plan swaps nothing), the
moments' stream with every run resident (``NvmeOptimizerState``, one run per unit and group, the fused
kernel) and the units' parts aligned for it. A plan that moves nothing thus steps through the stream's
resident buffers instead of the per-parameter inner optimizer: the same kernel and the same bits for
every parameter with a gradient, but a parameter that never gets one is decayed like its unit's others
(as under any streaming plan: Note [one run per parameter]).

Not re-placed (state first, as before; ``placement_report()["joint"]["why"]`` says why): at stage 3
(the candidates move shards, which the gatherer is reading and prefetching for the forward already
running, and change the parameter cache and the prefetch depth it was started with: declare the shape
there), with an accelerator at stages 1-2 (the joint search has no candidate but the state-first plan
there: only stage 3's shards give up device memory), without nvme_path (every candidate but the first
needs it), with an optimizer the fused Adam kernel does not run, and when gradients exist before the
first forward.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

from zeroshard.planner.auto_placement import KINDS, Plan
from zeroshard.units.tier import Tier

if TYPE_CHECKING:
    from zeroshard.offload.nvme_state import NvmeOptimizerState
    from zeroshard.offload.unit_swap import NvmeUnitStore
    from zeroshard.units.flat_unit import FlatUnit
    from zeroshard.units.run import Run


def same_layout(plan: Plan, built: Plan) -> bool:
    """``plan`` differs from ``built`` only in what a re-placement moves: gradients, separate masters and
    moments (the shards, the parameter cache and stage 3's prefetch depth as built)."""
    shard = KINDS.index("shard")
    return (all(a[shard] == b[shard] for a, b in zip(plan.tiers, built.tiers)) and plan.cached == built.cached
            and plan.deeper == built.deeper)


def moves(old: Plan, new: Plan) -> list[dict]:
    """Each unit's kind of state whose tier changes from ``old`` to ``new``, with its bytes."""
    return [{"unit": u.index, "kind": k, "from": old.tier(u.index, k).value, "to": new.tier(u.index, k).value,
             "bytes": u.size(k)}
            for u in new.units for k in KINDS if u.size(k) and old.tier(u.index, k) != new.tier(u.index, k)]


def gradients_exist(units: Sequence[FlatUnit]) -> Optional[str]:
    """Why the state is not moved: gradients already hold values (a swapped gradient keeps notes of its
    norm from the backward that wrote it, which a move would not make)."""
    n = sum(u.grad_valid for u in units)
    return f"{n} unit(s) hold gradients before the first forward" if n else None


def re_place(units: Sequence[FlatUnit], index: dict[int, int], runs: Sequence[Run], store: NvmeUnitStore,
             swapper: NvmeOptimizerState, new: Plan) -> None:
    """Moves the units' parts and the moments to ``new``'s tiers (Note [state re-placed at the first
    forward]): the parts it streams to the units' swap file, the others into memory; the moments of the
    runs it keeps in memory resident, the others streamed."""
    for unit in units:
        i = index[id(unit)]
        store.re_adopt(unit, [p for p in new.swapped(i) if p != "master" or unit.separate_master])
    swapper.re_place({id(r.tensor) for r in runs if new.tier(index[id(r.unit)], "moments") != Tier.NVME})
