"""XOR parity over groups of g ranks, the memory tier's alternative to a whole replica per rank
(``PeerRedundancy(parity=g)``): the layout of the groups and stripes, the XOR arithmetic, and
the commit's exchange over the side group.

Note [parity memory tier]:
Who holds what. The ranks form groups of g (consecutive ranks; over nodes, when
``LOCAL_WORLD_SIZE`` says there are at least g nodes and their count is a multiple of g, one
rank per node, the same local ranks together, so a node loss takes at most one member of each
group). At each commit, member i of a group (its position in the group) splits its own slot's
data into g - 1 chunks of C bytes (C: the group's longest slot data over g - 1, rounded up to
64; the tail zero-padded; the lengths travel in the members' stamps) and numbers them by the
stripes j != i (stripe j < i: chunk j; j > i: chunk j - 1). Stripe j's parity, the XOR of
the chunks of every member but j, is kept by member j in ``rank-<r>/parity/slot-{0,1}``
(RAID 5's rotation: a member never holds parity over its own data). Each member sends its
g - 1 chunks to the stripes' holders and XORs the g - 1 chunks it receives, point to point
over the tier's side gloo group while its own slot is stamped: the same bytes on the wire as
a replica. The parity slot's header holds every member's stamp, checksum and header, so a
lost member's slot can be stamped as it was.
Cost. C bytes per rank for a shard of L: 1/(g - 1) of the state (g = 4: 0.33x, against 1x
for a replica), the least any layout that keeps the parity inside the group can hold while
surviving the loss of any one member (the g - 1 survivors must hold L bytes about it between
them); the issue's 1/g needs a holder outside the group, which a node loss may take along.
Recovery (zeroshard/checkpoint/parity_rebuild.py). Member k lost (its own slot and parity
slot gone): for every stripe j != k, k's chunk is stripe j's parity XOR the chunks of the
other g - 2 members; stripe k (its parity lost with k) holds nothing of k's. The rank chosen
to rebuild (k mod the world size) receives the g - 1 survivors' own slots and parity slots,
rebuilds k's data, checks it against k's checksum (from a parity header; Note [slot checksum]), and writes it as
``rank-<me>/replica-<k>``: from there the replica mode's recovery loads it (any world size,
no disk). The groups are read from the parity stamps, so a restart at a world size g does not
divide (built with another ``parity=`` or none) still rebuilds. Two members of one group lost:
their chunks in a stripe are two unknowns in one equation; the disk checkpoint is loaded, with
one log line naming the group and the ranks.
Double buffering as for the own slots: the parity slot's stamp is removed first and written
last; the rebuild takes a step only when every survivor's own slot and parity slot of that
step verify, so a kill mid-commit leaves the previous step's slots and parity whole.
Preemption handoff (Note [preemption handoff] in zeroshard/checkpoint/memory_handoff.py).
The ranks agree on step k and commit it (own slots and parity); the leaving ranks' node memory
is taken to go with them. A group with one leaving member needs nothing more: the restart
rebuilds it from the survivors' own and parity slots of step k, as after a SIGKILL. Every
leaving member of a group that loses two or more (``exposed``) sends its own slot of step k
to the next staying rank along the ring, kept there as ``rank-<s>/replica-<r>`` (whole: one
copy, the same as the replica mode's handoff), so the restart at the smaller world finds every
owner of step k in memory (own, replica, or rebuilt) and reads no disk. When every rank
leaves there is no one to hand to: each node keeps its own ranks' slots and parity.
What is lost when. Nothing committed is lost to one member per group, or to a handoff. A
kill before step k's commit finished on every rank loses step k (the previous commit's slots
and parity are whole). Two members of one group lost without a handoff (two SIGKILLs, or a
preempted node killed by its scheduler before its push ended): the disk checkpoint.
A rebuilt slot (``rank-<me>/replica-<k>``) is removed as soon as the recovery has loaded it:
the survivors' own and parity slots it came from stay until their next commits, so a kill
before then rebuilds it again, and tmpfs does not keep a third copy of a lost rank's state for
the rest of the run. A pushed slot stays (it is the only copy until the smaller world commits).
"""
from __future__ import annotations

import os
from typing import Callable, Optional

import torch
import torch.distributed as dist

ALIGN = 64


def groups(world: int, g: int) -> list[list[int]]:
    """The parity groups of ``world`` ranks (Note [parity memory tier])."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world) or world)
    nodes = world // local if 0 < local < world and world % local == 0 else 1
    order = list(range(world))
    if nodes >= g and nodes % g == 0:  # one member per node: a node loss is one loss per group
        order = [n * local + lr for lr in range(local) for n in range(nodes)]
    return [order[i:i + g] for i in range(0, world, g)]


def group_of(rank: int, world: int, g: int) -> list[int]:
    return next(grp for grp in groups(world, g) if rank in grp)


def exposed(leaving: list[bool], g: int) -> list[int]:
    """The leaving ranks a handoff must push (Note [parity memory tier]): every leaving member of
    a group that loses more than one member (one XOR parity rebuilds one member of a group); a
    group's only leaving member is rebuilt from the committed step's parity at the restart."""
    return sorted(r for grp in groups(len(leaving), g) if sum(leaving[m] for m in grp) > 1
                  for r in grp if leaving[r])


def chunk_bytes(longest: int, g: int) -> int:
    """C: the bytes of one chunk (and of one rank's parity) for a group whose longest data is ``longest``."""
    return max(-(-(-(-longest // (g - 1))) // ALIGN) * ALIGN, ALIGN)


def chunk_index(member: int, stripe: int) -> int:
    """Which of member ``member``'s chunks lies in stripe ``stripe`` (!= member)."""
    if member == stripe:
        raise ValueError(f"member {member} has no chunk in its own stripe")
    return stripe if stripe < member else stripe - 1


def chunk(data: torch.Tensor, index: int, size: int) -> torch.Tensor:
    """Chunk ``index`` of ``data`` (uint8), ``size`` bytes, zero-padded past its end."""
    a, b = index * size, min((index + 1) * size, data.numel())
    if b - a == size:
        return data[a:b]
    out = torch.zeros(size, dtype=torch.uint8)
    if b > a:
        out[:b - a] = data[a:b]
    return out


def xor_into(acc: torch.Tensor, other: torch.Tensor) -> None:
    """acc ^= other (uint8 tensors of one size, a multiple of 8: XORed as int64 words)."""
    acc.view(torch.int64).bitwise_xor_(other.view(torch.int64))


def encode(datas: list[torch.Tensor], g: int) -> tuple[int, list[torch.Tensor]]:
    """(C, every member's stripe parity) of one group's data, computed in one place (what the
    commit's exchange computes across the members; for tests and the benchmark)."""
    size = chunk_bytes(max(d.numel() for d in datas), g)
    out = []
    for j in range(g):
        acc = torch.zeros(size, dtype=torch.uint8)
        for i in range(g):
            if i != j:
                xor_into(acc, chunk(datas[i], chunk_index(i, j), size))
        out.append(acc)
    return size, out


def rebuild(lost: int, g: int, size: int, nbytes: int, datas: dict[int, torch.Tensor],
            parities: dict[int, torch.Tensor]) -> torch.Tensor:
    """Member ``lost``'s data (``nbytes`` long) from the other members' data and stripe parities
    (by position in the group; chunk size ``size``)."""
    survivors = [i for i in range(g) if i != lost]
    if sorted(datas) != survivors or not set(survivors) <= set(parities):
        raise ValueError(f"rebuilding member {lost} needs the data and parity of members {survivors}; "
                         f"have data of {sorted(datas)}, parity of {sorted(parities)}")
    out = torch.zeros((g - 1) * size, dtype=torch.uint8)
    for j in survivors:
        acc = parities[j].clone()
        for i in survivors:
            if i != j:
                xor_into(acc, chunk(datas[i], chunk_index(i, j), size))
        c = chunk_index(lost, j)
        out[c * size:(c + 1) * size] = acc
    return out[:nbytes]


def exchange(side: dist.ProcessGroup, rank: int, members: list[int], data: torch.Tensor, meta: dict,
             target: Callable[[int], torch.Tensor]) -> tuple[int, dict[str, dict]]:
    """The commit's parity exchange (a collective of the side group): gathers every rank's data
    size and ``meta`` (its stamp, checksum and header), sends this member's chunks to the
    stripes' holders and XORs the chunks it receives into the buffer ``target(C)`` gives (this
    rank's parity slot). Returns (C, the group members' metas by rank)."""
    gathered: list[Optional[tuple[int, dict]]] = [None] * dist.get_world_size(side)
    dist.all_gather_object(gathered, (int(data.numel()), meta), group=side)
    sizes = {m: int(gathered[m][0]) for m in members}  # type: ignore[index]
    metas = {str(m): gathered[m][1] for m in members}  # type: ignore[index]
    g, me = len(members), members.index(rank)
    size = chunk_bytes(max(sizes.values()), g)
    parity = target(size)
    parity.zero_()
    glob = lambda r: dist.get_global_rank(side, r)  # noqa: E731
    sends = [dist.isend(chunk(data, chunk_index(me, j), size).contiguous(), glob(members[j]), group=side, tag=3)
             for j in range(g) if j != me]
    got = torch.empty(size, dtype=torch.uint8)
    for i in range(g):
        if i != me:
            dist.recv(got, glob(members[i]), group=side, tag=3)
            xor_into(parity, got)
    for w in sends:
        if w is not None:
            w.wait()
    return size, metas
