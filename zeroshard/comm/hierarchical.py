"""The data-parallel group of hpZ: every rank of a (node, local) mesh, with the ZeRO building
blocks split into an intra-node and an inter-node level.

Note [hpZ slice order]: under ``hpz=True`` optimizer state and gradients are partitioned over
all N = R x k ranks of the mesh (R nodes of k ranks: the primary partition), and each rank
also keeps a secondary partition of the parameters over the k ranks of its node (Note [hpZ
secondary partition] in zeroshard/stages/stage3/secondary.py). Both are equal slices of one
padded unit, and they nest: rank (node n, local l) owns primary slice ``l * R + n`` (of N),
which is sub-slice n of secondary slice l (of k). So the ranks holding the pieces of
secondary slice l are exactly rank l of every node (its inter-node group), and

- the secondary rebuild is an all-gather of the primary slices inside that inter-node group;
- a unit's gather is an all-gather of secondary slices inside the node;
- a gradient reduce-scatter is a reduce-scatter inside the node (each rank keeps the node's
  sum of its secondary slice) followed by a reduce-scatter of that 1/k slice across nodes
  (each keeps its primary slice): the slow links carry 1/k of the gradient;
- any other collective (norms, flags, objects) runs over the whole group.

torch sorts the ranks of a process group, so the primary slice index is not the group rank
(``shard_rank`` vs ``rank``): code that picks a rank's slice of a unit uses ``shard_rank``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.distributed as dist

from zeroshard.comm.process_group import Comm, Work, _Done

if TYPE_CHECKING:
    from zeroshard.comm.codecs.link_codecs import LinkCodecs


class _Then:
    """Two operations in sequence: the second starts once the first has completed (both
    levels of a hierarchical collective; every rank retires them in the same order)."""

    def __init__(self, first: Work, then: Callable[[], Work]) -> None:
        self.first, self.then = first, then

    def wait(self) -> bool:
        self.first.wait()
        self.then().wait()
        return True


class HierarchicalComm(Comm):
    """``Comm`` over all ranks of the mesh whose reduce-scatter and all-gather go through
    ``node`` (intra-node, dimension "shard") and ``inter`` (inter-node, "replicate"):
    Note [hpZ slice order]. Their traffic is counted by those two."""

    def __init__(self, group: Optional[dist.ProcessGroup], node: Comm, inter: Comm) -> None:
        super().__init__(group, dimension="dp")
        self.node, self.inter = node, inter
        self.levels = ((node, "@shard"), (inter, "@replicate"))
        """The sub-groups whose traffic ``comm_report`` adds (suffix, as for hybrid sharding)."""

    @property
    def shard_rank(self) -> int:
        return self.node.rank * self.inter.world_size + self.inter.rank

    @property
    def result_in_full(self) -> bool:
        return self.node.result_in_full and self.inter.result_in_full

    def _secondary(self, full: torch.Tensor) -> torch.Tensor:
        n = full.numel() // self.node.world_size
        return full[self.node.rank * n:(self.node.rank + 1) * n]

    def reduce_for_shard(self, full: torch.Tensor, shard_out: Optional[torch.Tensor],
                         codecs: Optional["LinkCodecs"] = None, key: Optional[str] = None) -> Work:
        """As ``Comm.reduce_for_shard`` for slice ``shard_rank``: reduce-scatter in the node,
        then of this rank's secondary slice across nodes (each level through its own link's
        codec: Note [quantized collectives])."""
        part = self._secondary(full)
        mid = part if self.node.result_in_full else torch.empty_like(part)
        first = self.node.reduce_for_shard(full, None if self.node.result_in_full else mid, codecs, key)

        def across() -> Work:
            if self.inter.result_in_full:  # (summed in place; copied out where asked)
                work = self.inter.reduce_for_shard(mid, None, codecs, key)
                if shard_out is None:
                    return work
                work.wait()
                n = mid.numel() // self.inter.world_size
                shard_out.copy_(mid[self.inter.rank * n:(self.inter.rank + 1) * n])
                return _Done()
            return self.inter.reduce_for_shard(mid, shard_out, codecs, key)
        return _Then(first, across)

    def gather_shards(self, full: torch.Tensor, codecs: Optional["LinkCodecs"] = None) -> Work:
        """As ``Comm.gather_shards`` with this rank's data in slice ``shard_rank``: across
        nodes into the secondary slice, then inside the node."""
        first = self.inter.gather_shards(self._secondary(full), codecs)
        return _Then(first, lambda: self.node.gather_shards(full, codecs))
