"""``offload="auto"`` with the micro-batch's shape measured at the first forward: the state's placement
chosen again there together with the activations, and the state moved to it before the first block
runs (Note [state re-placed at the first forward]).

Note [state re-placed at the first forward]: with a declared shape (``PlannedActivations(micro_batch=,
seq_len=)``) the state's placement and the activations are planned together at construction (Note
[joint state and activation plan] in zeroshard/planner/joint_plan.py). Measured, the shape is known
only at the first forward (at its first block; at stage 3 at the model's input), after the state was
placed (state first). There, before any block runs, the same joint search runs over the same
candidates (the construction plan among them, as its first), and where it picks another placement the
state moves to it. The gradients have no value
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

At stage 3 the first block is too late: by its pre-hook the gatherer has gathered the root unit and is
reading and prefetching the blocks' shards for the forward already running, and the candidates move
those shards (to the swap file or back), the parameter cache and the read-ahead depth the gatherer
uses. So there the shape is read from the model's input instead, by a forward pre-hook on the model
registered first (``prepend=True``: before stage 3's own root hooks) with the keyword arguments: the
first positional tensor, or ``input_ids=``, when it is a 2-D integer tensor of token ids (TinyGPT,
Hugging Face causal LMs), gives (micro-batch, sequence) (``root_shape`` in plan_at_forward.py). Nothing
is gathered or being read then (``stage3_blocker`` checks; a forward that raised before its first block
leaves the root unit gathered: state first), no step is in flight (none ran), and the search runs over
every candidate: ``re_adopt`` moves shards as it moves other parts (a shard arriving is written with its
values, one leaving read back), the units' swap file serving them through ``swap_holding`` like any
shard placed there at construction. The parameter cache becomes the new plan's (empty until step 1
where the peak is calibrated, as at construction) and the gatherer's ``max_live`` its read-ahead. The
first block then sees as many tokens (micro-batch x sequence, its input's elements / d_model) and plans
nothing more; a longer one plans the activations again, in what the re-placed state leaves. With more
than one rank each measures its own micro-batch, so the read-ahead stays as built there: a depth that
differed across ranks would order the gathers' collectives differently around the reductions. Where
the input gives no shape the first block measures it: state first, with the reason.

For that the structure the joint plan may need is built at construction whenever a re-placement is
possible (``re_place_blocker`` is None): the units' swap file (empty while the plan swaps nothing), the
moments' stream with every run resident (``NvmeOptimizerState``, one run per unit and group, the fused
kernel) and the units' parts aligned for it (at stage 3 every shard too, so a shard moved there is read
and written with O_DIRECT; such a shard is never lent to its gather, which copies it: Note [gather by
alias]). A plan that moves nothing thus steps through the stream's resident buffers instead of the
per-parameter inner optimizer: the same kernel and the same bits for every parameter with a gradient;
a parameter without one keeps its values and moments (Note [untouched parts of a streamed run] in
nvme_state.py), only the run's shared step count moves on.

Not re-placed (state first, as before; ``placement_report()["joint"]["why"]`` says why): with an
accelerator (at stages 1-2 the joint search has no candidate but the state-first plan: only stage 3's
shards give up device memory; at stage 3 its candidates move shards from the device to host memory, and
a shard's tensor stays on the device it was built on), at stage 3 when the input gives no shape or units
are gathered then, under hpZ (its secondary partition copies the shards as built), without nvme_path
(every candidate but the first needs it), with an optimizer the fused Adam kernel does not run, and when
gradients exist before the first forward.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

from zeroshard.planner.auto_placement import KINDS, Plan
from zeroshard.stages.stage3.unit_state import UnitState
from zeroshard.units.tier import Tier

if TYPE_CHECKING:
    from zeroshard.stages.stage3.gatherer import ParameterGatherer
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


STAGE3_AT_BLOCK = ("at stage 3 the shape is measured at the model's input, before any unit is gathered, and its first "
                   "positional tensor (or input_ids=) was not an integer (micro-batch, sequence) tensor of token ids; "
                   "by the first block the gatherer is reading and prefetching the shards a re-placement would move "
                   "(state first); declare the shape, PlannedActivations(micro_batch=..., seq_len=...), to plan the "
                   "two together")
"""Why a stage-3 run whose input gave no shape keeps the state first (Note [state re-placed at the
first forward])."""


HPZ = ("hpZ's secondary partition keeps copies of the shards from construction, which a re-placement does not "
       "follow: state first")


def stage3_blocker(gatherer: ParameterGatherer, at_root: bool) -> Optional[str]:
    """Why stage 3's state is not moved: the shape was measured at the first block (the input gave none),
    hpZ, or some unit is gathered or being read (a forward that raised before its first block left the
    root so), and a re-placement moves what a gather reads; None: it may be."""
    if not at_root:
        return STAGE3_AT_BLOCK
    if gatherer.secondary is not None:
        return HPZ
    n = sum(state is not UnitState.RELEASED for state in gatherer.state)
    return f"{n} stage-3 unit(s) gathered or being read before the first forward" if n else None


def re_place(units: Sequence[FlatUnit], index: dict[int, int], runs: Sequence[Run], store: NvmeUnitStore,
             swapper: NvmeOptimizerState, new: Plan) -> None:
    """Moves the units' parts and the moments to ``new``'s tiers (Note [state re-placed at the first
    forward]): the parts it streams to the units' swap file, the others into memory; the moments of the
    runs it keeps in memory resident, the others streamed."""
    for unit in units:
        i = index[id(unit)]
        store.re_adopt(unit, [p for p in new.swapped(i) if p != "master" or unit.separate_master])
    swapper.re_place({id(r.tensor) for r in runs if new.tier(index[id(r.unit)], "moments") != Tier.NVME})
