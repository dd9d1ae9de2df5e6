"""A construction refused on one rank is refused on every rank (issue 43).

Note [agreed construction]: validation that depends on the rank's own environment -- its
``nvme_path`` (per-node paths differ in real jobs), its disk, its memory budget -- can refuse on
one rank only. That rank raised and exited while the others returned a working optimizer and
died in their first collective ("Connection closed by peer" with gloo; with NCCL they waited
for the process group's timeout). So after the assembly (Note [assembly]), before any rank
returns or commits, the ranks exchange one status each -- ``None`` or the refusal's type and
message -- with one ``all_gather_object`` over each group the construction already used (the
shard group, then the replicas and the tp group): every rank that passed takes its
construction back (Note [refused construction]) and every rank raises the same error, naming
the refused rank(s) and the refusal, whose message names the argument.

The exchange runs only once the construction's own collectives are behind the rank (the
broadcast of rank 0's values: ``ConstructionRecord.collectives_done``), so it never meets another
collective: a rank refused before that point (an argument checked before any state is built,
the same on every rank of a script) raises alone, as before. Nothing is exchanged in one
process or a group of one. Cost: one small object all-gather per construction.
"""
from __future__ import annotations

import builtins
from typing import TYPE_CHECKING, Callable, Optional, TypeVar

from zeroshard.comm.mesh import MeshInfo

if TYPE_CHECKING:
    from zeroshard.optim.construction import ConstructionRecord

T = TypeVar("T")

_STANDARD = (ValueError, TypeError, RuntimeError, OSError, MemoryError, NotImplementedError)


def agree(mesh: MeshInfo, failure: Optional[BaseException]) -> None:
    """Returns when no rank of ``mesh``'s groups was refused; otherwise raises the same error
    on every rank (chained to ``failure`` on the refused rank)."""
    comms = [c for c in (mesh.comm, mesh.replicas, mesh.tp.comm if mesh.tp is not None else None)
             if c is not None and c.world_size > 1 and getattr(c, "group", None) is not None]
    if not comms:
        if failure is not None:
            raise failure
        return
    import torch.distributed as dist
    mine = None if failure is None else (dist.get_rank(), type(failure).__name__, str(failure))
    refused = {mine[0]: mine} if mine is not None else {}
    for comm in comms:  # (in turn: a refusal reaches every rank of a grid of groups)
        for statuses in comm.all_gather_object(sorted(refused.values())):
            refused.update({s[0]: s for s in statuses})
    if not refused:
        return
    first = refused[min(refused)]
    cls = getattr(builtins, first[1], None)
    if not (isinstance(cls, type) and issubclass(cls, _STANDARD)):
        cls = RuntimeError
    others = f" (also refused on rank(s) {sorted(refused)[1:]})" if len(refused) > 1 else ""
    message = f"ZeroOptimizer refused on rank {first[0]}{others}, so on every rank: {first[1]}: {first[2]}"
    if failure is not None and type(failure).__name__ == first[1]:
        # (a rank refused like the first keeps its own error -- its type and attributes, e.g.
        # PlacementError.minimum, which callers read -- with the agreed message)
        failure.args = (message,)
        raise failure
    error = cls(message)
    if failure is not None:
        raise error from failure
    raise error


def agreed(attached: "ConstructionRecord", build: Callable[[], T]) -> T:
    """``build()`` (an assembly recording into ``attached``), whose outcome every rank agrees on
    once the construction's collectives are behind (``attached.collectives_done``)."""
    failure: Optional[Exception] = None
    try:
        built = build()
    except Exception as exc:
        if not attached.collectives_done:
            raise
        failure = exc
    if attached.collectives_done and attached.mesh is not None:
        agree(attached.mesh, failure)
    return built
