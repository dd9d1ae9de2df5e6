"""Reports a ZeroOptimizer gives about itself: memory by category, communication by
collective, and the NVMe staging slots its memory bound allows."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import torch

from zeroshard.memory import MemoryReport, tensor_bytes
from zeroshard.offload.unit_swap import NvmeUnitStore
from zeroshard.units.flat_unit import FlatUnit

if TYPE_CHECKING:
    from zeroshard.comm.mesh import MeshInfo
    from zeroshard.units.run import Run
    from zeroshard.optim.zero_engine import Engine, EngineOwner


def memory_report(opt: "EngineOwner") -> MemoryReport:
    """Bytes of model state this rank holds, by category. State kept in swap files counts
    as ``offloaded``; its parts read into memory for a moment (the swap pipeline's working
    set) count as ``buffers``, like the gather buffers of stage 3."""
    engine = opt.engine.joined()
    seen: set[int] = set()
    managed = engine.segment_index()  # (stage 3: frozen weights live in frozen units, counted below)
    frozen = sum(tensor_bytes(p, seen) for g in opt.param_groups for p in g["params"]
                 if not p.requires_grad and id(p) not in managed)
    frozen_units = engine.frozen_units
    frozen += sum(0 if u.swapped("shard") else tensor_bytes(u.shard, seen) for u in frozen_units)
    frozen_offloaded = sum(u.shard.numel() * u.shard.element_size() for u in frozen_units if u.swapped("shard"))

    def held(unit: FlatUnit, part: str, t: torch.Tensor) -> int:
        return 0 if unit.swapped(part) else tensor_bytes(t, seen)
    staging = sum(tensor_bytes(NvmeUnitStore.tensor_of(u, p), seen)
                  for u in engine.all_units if u.swap is not None for p in u.swap.parts_of(u))
    return MemoryReport(
        parameters=sum(held(u, "shard", u.shard if u.policy.shard_parameters else u.flat)
                       for u in engine.units) + frozen,
        frozen=frozen, frozen_offloaded=frozen_offloaded,
        gradients=sum(held(u, "grad", u.grad_store) for u in engine.units),
        master_weights=sum(held(u, "master", u.master) for u in engine.units if u.separate_master),
        optimizer_states=(engine.swapper.pool_bytes + engine.swapper.resident_bytes if engine.swapper is not None else
                          sum(tensor_bytes(v, seen) for s in engine.inner.state.values()
                              for v in s.values() if isinstance(v, torch.Tensor))),
        offloaded=((engine.swapper.file_bytes if engine.swapper is not None else 0)
                   + (engine.unit_store.file_bytes if engine.unit_store is not None else 0)),
        buffers=(engine.reducer.live_bucket_bytes()
                 + (engine.stage3_gatherer.gathered_bytes() if engine.shards_parameters else 0) + staging),
        secondary=_secondary_bytes(engine),
        memory_tier=engine.memory_tier.bytes_held() if engine.memory_tier is not None else 0,
        activations_moved=(engine.activations.report()["bytes_moved_last_step"] if engine.activations is not None
                           else 0),
    )


def placement_report(engine: "Engine", micro_batches: int) -> dict:
    """The placement's report (offload/placement.py), with activation offload's traffic beside it."""
    report = engine.placement.report(engine.runs, engine.swapper, micro_batches)
    if engine.activations is not None:  # (offload_activations: Note [activation offload])
        report["activations"] = engine.activations.report()
    return report


def _secondary_bytes(engine: "Engine") -> int:
    """hpZ's secondary partition (stage 3 only: Note [hpZ secondary partition])."""
    secondary = engine.stage3_gatherer.secondary if engine.shards_parameters else None
    return secondary.nbytes() if secondary is not None else 0


def comm_report(mesh: MeshInfo, reset: bool = False) -> dict[str, dict]:
    """``memory_report``'s sibling: what this rank's collectives moved since construction
    (or the last ``reset``), by kind: calls, bytes and the group dimension crossed; over the
    shard group (and hpZ's levels of it), the replicas of a hybrid mesh, the tp and pp groups."""
    shard_comm, replicas, tp, pp = mesh.comm, mesh.replicas, mesh.tp, mesh.pp
    out = {}
    # (hpZ: the node and inter-node levels of the data-parallel group, Note [hpZ slice order])
    for comm, suffix in ((shard_comm, ""), (replicas, "@replicate"), (tp.comm if tp else None, "@tp"),
                         (pp.comm if pp else None, "@pp"),
                         *getattr(shard_comm, "levels", ())):
        if comm is None:
            continue
        out.update({kind + suffix: {"calls": t.calls, "bytes": t.bytes, "dimension": t.dimension}
                    for kind, t in sorted(comm.traffic.items())})
        if reset:
            comm.traffic.clear()
    return out


def staging_slots(offload_buffer_mb: Optional[float], runs: Sequence[Run], units: Sequence[FlatUnit]) -> int:
    """How many pipeline slots NVMe offload may use within ``offload_buffer_mb``: each holds
    the largest run's moments and the largest unit's swapped parts."""
    if offload_buffer_mb is None:
        return 3
    moments = max((8 * r.tensor.numel() for r in runs), default=0)
    parts = max((sum(NvmeUnitStore.tensor_of(u, p).numel() * NvmeUnitStore.tensor_of(u, p).element_size()
                     for p in (u.swap.parts_of(u) if u.swap is not None else ())) for u in units), default=0)
    per_slot = moments + parts
    slots = int(offload_buffer_mb * 2**20 // max(1, per_slot))
    if slots < 1:
        raise ValueError(
            f"offload_buffer_mb={offload_buffer_mb} is below one staging slot of "
            f"{per_slot / 2**20:.1f} MiB (the largest unit's moments, gradient and master); raise it, or make "
            "units smaller (bucket_size_mb, or stage3_unit_numel at stage 3)")
    return slots
