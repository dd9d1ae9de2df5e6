"""Which ZeroOptimizer owns a parameter: claiming, refusing a second owner, handing back.

A ZeroOptimizer hooks its parameters (gradient hooks move every gradient into its buckets and
clear ``.grad``), so a second one over the same parameters would train on nothing while the
first is alive: that is refused, naming the parameters. Once the first is closed
(``close()``) or garbage collected (``teardown.Teardown``), its hooks, stage-3 forward hooks
and module guard are removed and the parameters may be wrapped again; at stage 3 they are
handed back first. Nothing here holds the optimizer strongly: each parameter names its owner
through a weak reference, so ``del opt`` really frees it.
"""
from __future__ import annotations

import gc
import weakref
from typing import TYPE_CHECKING, Optional, Sequence

import torch
from torch import nn

from zeroshard.comm.tensor_parallel import is_dtensor

if TYPE_CHECKING:
    from zeroshard.stages.stage3.gatherer import ParameterGatherer
    from zeroshard.units.flat_unit import FlatUnit

_OWNER = "_zeroshard_owner"  # attribute on each managed parameter: weakref to its optimizer


def live_owner(p: torch.Tensor) -> Optional[object]:
    ref = getattr(p, _OWNER, None)
    opt = ref() if ref is not None else None
    return opt if opt is not None and not getattr(opt, "closed", False) else None


def check_unclaimed(params: Sequence[torch.Tensor], names: dict[int, str]) -> None:
    """Refuses parameters another live ZeroOptimizer manages (after collecting garbage: an
    optimizer the user dropped may still sit in a reference cycle)."""
    if not any(live_owner(p) is not None for p in params):
        return
    gc.collect()
    taken = [p for p in params if live_owner(p) is not None]
    if taken:
        shown = ", ".join(repr(names.get(id(p), "?")) for p in taken[:3])
        more = f" and {len(taken) - 3} more" if len(taken) > 3 else ""
        raise RuntimeError(
            f"parameter(s) {shown}{more} already belong to a live ZeroOptimizer "
            f"({live_owner(taken[0])!r}), whose hooks take their gradients; a second one would train "
            "on zeros. Call close() on the first (or delete every reference to it) before building "
            "another, or use param groups in one optimizer for different settings")


def claim(params: Sequence[torch.Tensor], opt: object) -> None:
    ref = weakref.ref(opt)
    for p in params:
        setattr(p, _OWNER, ref)


def hand_back_stage3(gatherer: "ParameterGatherer", units: Sequence["FlatUnit"]) -> None:
    """Stage 3 closing: every unit gathered once more and each parameter given its own full
    tensor, so the model works without the optimizer (a collective: all ranks call it)."""
    for ui in range(len(units)):
        gatherer.ensure_exact(ui)
    with torch.no_grad():
        for unit in units:
            for m, seg in zip(unit.members, unit.layout.segments):
                own = seg.bind(unit.flat[seg.offset:seg.end]).clone()
                if is_dtensor(m.param):  # (its local shard: Note [tensor-parallel parameters])
                    m.param._local_tensor = own
                else:
                    m.param.data = own
    gatherer.release_all()


def hand_back_collected(gatherer: "ParameterGatherer", units: Sequence["FlatUnit"], world_size: int) -> None:
    """Stage 3, the optimizer collected without ``close()``: no collective can run from a
    finalizer (other ranks collect theirs at other times). One rank holds everything, so it
    gets its full parameters as ``close()`` gives them; with more, every parameter stays the
    sharded one torch code saw between uses (Note [sharded parameters]), with its shard in
    memory, so reads, ``state_dict()``, ``zeroshard.full_state_dict`` and SPMD ops stay correct."""
    if world_size == 1:
        hand_back_stage3(gatherer, units)
        return
    gatherer.settle()
    for unit in units:
        store = getattr(unit, "swap", None)
        if store is not None and store.swaps(unit, "shard"):
            store.load(unit, ("shard",))
        unit.swap = None  # (its files close with the optimizer)
    gatherer.keep_sharded = True


def take_back_collected(module: nn.Module) -> None:
    """A new optimizer over a model whose stage-3 optimizer was collected at world > 1
    (``hand_back_collected`` left its parameters the sharded ones): each gets its full values
    back as an ordinary parameter first, tied ones once (a collective, as every construction
    is: all ranks build the optimizer, in the same module order). DeepSpeed's tests build a
    fresh engine on the same model and load a checkpoint into it."""
    from zeroshard.stages.sharded_tensor import ShardedTensor
    full: dict[int, nn.Parameter] = {}
    with torch.no_grad():
        for sub in module.modules():
            for name, p in list(sub._parameters.items()):
                if not isinstance(p, ShardedTensor) or p.unit is None or any(
                        live_owner(m.param) is not None for m in p.unit.members):
                    continue  # (a live optimizer's: the construction refuses it, naming it)
                if id(p) not in full:
                    full[id(p)] = nn.Parameter(p.full().clone(), requires_grad=p.requires_grad)
                sub._parameters[name] = full[id(p)]
