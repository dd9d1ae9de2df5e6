"""A lost rank's memory-tier slot rebuilt from its parity group's survivors (``PeerRedundancy(parity=g)``):
the step chosen, the survivors' slots and parity sent to one rank, XORed, checked against the
lost slot's checksum and written as a replica, for ``memory_recovery.recover`` to load as any
other (Note [parity memory tier] in zeroshard/resilience/parity.py)."""
from __future__ import annotations

import os
import shutil
from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.distributed as dist

from zeroshard.resilience import checksum, parity, slots

if TYPE_CHECKING:
    from zeroshard.resilience.memory_tier import MemoryTier

Item = tuple[str, int]  # ("own" | "parity", rank whose slot it is)


def parity_slots(root: str, run_id: str, digest: str) -> list[slots.SlotInfo]:
    """The valid parity slots under this node's tier root."""
    out: list[slots.SlotInfo] = []
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return out
    for rdir in names:
        base = os.path.join(root, rdir, "parity")
        if rdir.startswith("rank-") and not os.path.islink(os.path.join(root, rdir)) and os.path.isdir(base):
            out += [s for s in slots.scan(base, run_id, digest) if s.problem is None]
    return out


def plan(everyone: list[tuple[list, list]]) -> tuple[Optional[tuple[int, int, dict[int, list[int]]]], str]:
    """((step, saved world, lost rank -> its group) to rebuild, or None; why the newest step
    cannot be rebuilt, "" when it can or needs nothing). ``everyone[r]``: (own slots as
    (owner, step, world, bytes), parity slots as (holder, step, world, group, chunk)) rank r reads."""
    owners: dict[tuple[int, int], set[int]] = {}
    groups: dict[tuple[int, int], dict[int, list[int]]] = {}
    for own, par in everyone:
        for owner, step, n, _ in own:
            owners.setdefault((step, n), set()).add(owner)
        for holder, step, n, grp, _ in par:
            groups.setdefault((step, n), {})[holder] = list(grp)
    why = ""
    for key in sorted(set(owners) | set(groups), reverse=True):
        step, n = key
        have, pars = owners.get(key, set()), groups.get(key, {})
        missing = [o for o in range(n) if o not in have]
        if not missing:
            return None, why
        lost: dict[int, list[int]] = {}
        for k in missing:
            grp = next((gr for gr in pars.values() if k in gr), None)
            gone = sorted(set(missing) & set(grp)) if grp is not None else [k]
            no_parity = sorted(m for m in (grp or []) if m != k and m not in pars)
            if grp is None:  # (no parity names it: its whole group is gone, or a replica tier's, whose report says why)
                why = why or (f"step {step}: rank {k}'s slot is gone and no parity slot of its group survives "
                              "(every member of the group is lost)" if pars else "")
                break
            if len(gone) > 1 or no_parity:
                why = why or (f"step {step}: parity group {grp} lost the slots of rank(s) {gone} (one XOR parity "
                              "rebuilds one member of a group)" if len(gone) > 1 else
                              f"step {step}: rank {k}'s slot is gone and so is the parity of rank(s) {no_parity} "
                              f"of its group {grp}")
                break
            lost[k] = grp
        else:
            return (step, n, lost), ""
    return None, why


def rebuild(tier: "MemoryTier", found: list[slots.SlotInfo], digest: str,
            gather: Callable[[object], list]) -> tuple[list[int], str]:
    """Rebuilds the slots the newest step lacks from their groups' parity (a collective of the
    tier's group). Returns (the ranks whose slots were rebuilt, why the newest step cannot be)."""
    comm = tier.comm  # (the groups are the stamps': the tier may now run another parity, or none)
    par = parity_slots(tier.root, tier.run_id, digest)
    own = [(s.stamp["owner"], s.step, s.stamp["world_size"], s.stamp["data_bytes"]) for s in found]
    pars = [(s.stamp["owner"], s.step, s.stamp["world_size"], s.stamp.get("parity_group"), s.stamp.get("chunk"))
            for s in par if isinstance(s.stamp.get("parity_group"), list) and isinstance(s.stamp.get("chunk"), int)]
    everyone = gather((own, pars))
    chosen, why = plan(everyone)
    if chosen is None:
        return [], why
    step, n, lost = chosen
    me, world = comm.rank, comm.world_size

    def holders(kind: str, r: int) -> list[int]:
        return [q for q, (o, p) in enumerate(everyone)
                if any(e[0] == r and e[1] == step and e[2] == n for e in (o if kind == "own" else p))]

    def job(k: int, item: Item) -> tuple[int, Item, int, int]:  # (the rebuilding rank serves itself where it can)
        held, dst = holders(*item), k % world
        return k, item, dst if dst in held else held[0], dst
    jobs = [job(k, (kind, r)) for k in sorted(lost) for r in lost[k] if r != k for kind in ("own", "parity")]
    served: dict[Item, torch.Tensor] = {}
    metas: dict[int, dict] = {}
    chunk: dict[int, int] = {}
    problem: Optional[str] = None
    for k, (kind, r), src, _ in jobs:
        if src != me or (kind, r) in served:
            continue
        info = next(s for s in (found if kind == "own" else par)
                    if s.stamp["owner"] == r and s.step == step and s.stamp["world_size"] == n)
        try:
            header, data = slots.read(info)
            served[(kind, r)] = data
            if kind == "parity":
                metas[k] = header["members"][str(k)]
                chunk[k] = int(info.stamp["chunk"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            problem = f"{info.path}: {exc}"
    for p, m, c in gather((problem, metas, chunk)):
        problem = problem or p
        metas.update(m)
        chunk.update(c)
    if problem:
        return [], f"step {step}: the parity rebuild of rank(s) {sorted(lost)} could not read {problem}"
    glob = ((lambda q: dist.get_global_rank(comm.group, q)) if comm.group is not None else (lambda q: q))
    got: dict[tuple[int, Item], torch.Tensor] = {}
    works = []
    for i, (k, item, src, dst) in enumerate(jobs):
        if src == me and dst != me:
            works.append(dist.isend(served[item], glob(dst), group=comm.group, tag=200 + i))
        elif dst == me and src != me:
            size = next(e[3] for e in everyone[src][0] if e[0] == item[1] and e[1] == step and e[2] == n) \
                if item[0] == "own" else chunk[k]
            got[(k, item)] = torch.empty(size, dtype=torch.uint8)
            works.append(dist.irecv(got[(k, item)], glob(src), group=comm.group, tag=200 + i))
        elif dst == me:
            got[(k, item)] = served[item]
    for w in works:
        if w is not None:
            w.wait()
    failed: Optional[str] = None
    for k, grp in lost.items():
        if k % world != me:
            continue
        meta = metas[k]
        pos = grp.index
        data = parity.rebuild(pos(k), len(grp), chunk[k], int(meta["data_bytes"]),
                              {pos(r): got[(k, ("own", r))] for r in grp if r != k},
                              {pos(r): got[(k, ("parity", r))] for r in grp if r != k})
        try:  # (with the algorithm the member's stamp names: Note [slot checksum])
            crc = checksum.of(meta["stamp"].get("checksum", checksum.CRC32), data)
        except ValueError as exc:
            failed = f"rank {k}'s rebuilt slot cannot be checked here ({exc})"
            continue
        if crc != meta["data_crc32"]:
            failed = f"rank {k}'s rebuilt slot does not match its checksum"
            continue
        try:
            slot = slots.begin(os.path.join(tier.root, f"rank-{me}", f"replica-{k}"))
            slots.write_data(slot, data.numpy().data)
            slots.finish(slot, {**meta["stamp"], "rebuilt": True}, meta["header"].encode(), data.numel(), crc)
        except OSError as exc:
            failed = f"writing rank {k}'s rebuilt slot failed ({exc.strerror or exc})"
    fails = [f for f in gather(failed) if f]
    if fails:
        return [], f"step {step}: the parity rebuild of rank(s) {sorted(lost)} failed: {fails[0]}"
    return sorted(lost), ""


def release(tier: "MemoryTier") -> int:
    """Removes the slots this rank rebuilt (stamped ``rebuilt``) once the recovery has loaded them
    or fallen back to the disk: the survivors' slots they came from still rebuild them until the
    next commit, so tmpfs keeps no third copy for the rest of the run (Note [parity memory tier]).
    Returns the slots removed."""
    base = os.path.join(tier.root, f"rank-{tier.rank}")
    try:
        subs = [d for d in os.listdir(base) if d.startswith("replica-")]
    except OSError:
        return 0
    removed = 0
    for sub in subs:
        for name in slots.SLOTS:
            slot = os.path.join(base, sub, name)
            stamp = slots.read_stamp(slot)
            if stamp is not None and stamp.get("rebuilt") is True and not os.path.islink(slot):
                shutil.rmtree(slot, ignore_errors=True)
                removed += 1
        try:
            os.rmdir(os.path.join(base, sub))  # (only when empty)
        except OSError:
            pass
    return removed
