"""``offload="auto"`` with the micro-batch's shape measured at the first forward: the state's placement
chosen again there together with the activations, and the state moved to it before the first step
(Note [state re-placed at the first forward]).

Note [state re-placed at the first forward]: with a declared shape (``PlannedActivations(micro_batch=,
seq_len=)``) the state's placement and the activations are planned together at construction (Note
[joint state and activation plan] in zeroshard/planner/joint_plan.py). Measured, the shape is known
only at the first forward's first block, after the state was placed (state first). There, before any
block runs, the same joint search runs over the same candidates (the construction plan among them, as
its first), and where it picks another placement the state moves to it. Nothing of the state has a
value that must move but the weights: the gradients are written by the first backward (the units'
gradients are not valid yet: a part leaving the swap file is allocated, not read) and the Adam moments
are made by the first step (``NvmeOptimizerState`` starts them at zero), so moving means giving the
units' swap file the parts the new plan streams (``NvmeUnitStore.re_adopt``: a weight part is written,
a gradient only given a region) or taking them back, and laying the moments out again
(``NvmeOptimizerState.re_place``). The run then holds what a run with the shape declared holds (same
parts swapped, same moments resident, same kernel over the same runs), so its bits are the same.

For that the structure the joint plan may need is built at construction whenever a re-placement is
possible (``blocker`` is None): the units' swap file (empty while the plan swaps nothing), the
moments' stream with every run resident (``NvmeOptimizerState``, one run per unit and group, the fused
kernel) and the units' parts aligned for it. A plan that moves nothing thus steps through the stream's
resident buffers instead of the per-parameter inner optimizer: the same kernel and the same bits for
every parameter with a gradient, but a parameter that never gets one is decayed like its unit's others
(as under any streaming plan: Note [one run per parameter]).

Not re-placed (state first, as before; ``placement_report()["joint"]`` says why): with an
accelerator (the candidates move shards and moments between device and host memory, which this does
not do), at stage 3 (shards are read for the gathers of the forward already running), without
nvme_path (every candidate but the first needs it), with an optimizer the fused Adam kernel does not
run, and when state exists before the first forward (a checkpoint loaded: the moments have values).
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


def state_exists(units: Sequence[FlatUnit], swapper: Optional[NvmeOptimizerState]) -> Optional[str]:
    """Why the state cannot move as values-free parts: moments or gradients already hold values."""
    if swapper is not None and len(swapper):
        return (f"the optimizer state of {len(swapper)} run(s) exists before the first forward (a checkpoint "
                "loaded): moments are only re-placed before they exist")
    if any(u.grad_valid for u in units):
        return "gradients exist before the first forward"
    return None


def re_place(units: Sequence[FlatUnit], index: dict[int, int], runs: Sequence[Run], store: NvmeUnitStore,
             swapper: NvmeOptimizerState, new: Plan) -> None:
    """Moves the units' parts and the moments to ``new``'s tiers (Note [state re-placed at the first
    forward]): the parts it streams to the units' swap file, the others into memory; the moments of the
    runs it keeps in memory resident, the others streamed."""
    for unit in units:
        i = index[id(unit)]
        store.re_adopt(unit, [p for p in new.swapped(i) if p != "master" or unit.separate_master])
    swapper.re_place({id(r.tensor) for r in runs if new.tier(index[id(r.unit)], "moments") != Tier.NVME})
