"""Recovery from the memory tiers: the newest step every owner's pieces are covered for (own
slot or buddy replica, on any node), agreed by every rank, loaded at the current world size
through ``load_checkpoint``'s read and apply phases with the pieces sent over the process
group instead of read from files (Note [peer memory tier] in tier.py). No disk is read."""
from __future__ import annotations

import os
import socket
import warnings
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist
from torch import nn

from zeroshard.checkpoint import codec_residuals, parity_rebuild, trainer_state
from zeroshard.checkpoint.checkpoint_errors import CheckpointError
from zeroshard.checkpoint.load import _Source, _held, apply_phase, check_compatible, read_phase
from zeroshard.checkpoint.pieces import gather_table
from zeroshard.checkpoint.shard_file import DTYPES, ShardReader
from zeroshard.checkpoint.state_check import check_state_kinds
from zeroshard.optim.interrupts import state_restored
from zeroshard.resilience import slots
from zeroshard.checkpoint.memory_commit import digest_of
from zeroshard.resilience.memory_tier import MemoryTier
from zeroshard.testing import kill_points

if TYPE_CHECKING:
    from zeroshard.comm import Comm
    from zeroshard.optim.zero_optimizer import ZeroOptimizer

Key = tuple[int, str, int, str]  # (owner rank, name, start, kind)
RESIDUAL = "codec_residual"
"""The kind of a gradient residual's key (codec_residuals.py: restored at the same world size only)."""


def local_slots(root: str, run_id: str, digest: str) -> tuple[list[slots.SlotInfo], list[str]]:
    """(usable slots, refusals) under this node's tier root."""
    found, refused = [], []
    try:
        ranks = sorted(os.listdir(root))
    except OSError:
        return [], []
    for rdir in ranks:
        base = os.path.join(root, rdir)
        if not rdir.startswith("rank-") or os.path.islink(base) or not os.path.isdir(base):
            continue
        for sub in sorted(os.listdir(base)):
            if sub == "own" or sub.startswith("replica-"):
                for info in slots.scan(os.path.join(base, sub), run_id, digest):
                    (refused.append(f"{info.path}: {info.problem}") if info.problem else found.append(info))
    return found, refused


def _entries(owner: int, header: dict, size: int) -> tuple[list[dict], dict[Key, tuple[torch.dtype, int, int]]]:
    """The owner's piece entries (manifest form) and where each tensor lies in its data;
    ValueError where the header does not fit the data (never trusted)."""
    entries, where = [], {}

    def place(name: str, start: int, kind: str, spec: object) -> None:
        if not isinstance(spec, dict) or spec.get("dtype") not in DTYPES:
            raise ValueError(f"rank {owner}'s slot: malformed entry for {name}")
        off, n, dtype = spec.get("offset"), spec.get("numel"), DTYPES[spec["dtype"]]
        if not (isinstance(off, int) and isinstance(n, int) and 0 <= off and 0 <= n
                and off + n * dtype.itemsize <= size and off % dtype.itemsize == 0):
            raise ValueError(f"rank {owner}'s slot: {name} lies outside its data")
        where[(owner, name, start, kind)] = (dtype, off, n)
    for p in header["pieces"]:
        for kind, spec in p["keys"].items():
            place(p["name"], p["start"], kind, spec)
        entries.append({"name": p["name"], "start": p["start"], "stop": p["stop"], "file": f"rank-{owner}",
                        "keys": {k: k for k in p["keys"]}, "scalars": p["scalars"]})
    for name, spec in header.get("residuals", {}).items():  # (this owner's alone: no entry, no reshard)
        place(name, 0, RESIDUAL, spec)
    for name, spec in header["full"].items():
        place(name, 0, "param", spec)
        entries.append({"name": name, "start": 0, "stop": spec["numel"], "file": f"rank-{owner}",
                        "keys": {"param": "param"}, "scalars": {}})
    return entries, where


class MemorySource(_Source):
    """``_Source`` for the read/apply phases, fed from the tiers: ``plan`` notes the pieces this
    rank needs, ``read_planned`` has their servers send them."""

    adoptable = False

    def __init__(self, body: dict, comm: "Comm", servers: dict[int, int], local: dict[int, torch.Tensor],
                 where: dict[Key, tuple[torch.dtype, int, int]], step: int) -> None:
        super().__init__("memory tier", body)
        self.comm, self.servers, self.local, self.where, self.step = comm, servers, local, where, step
        self.needed: dict[Key, tuple[int, int]] = {}
        """Each piece this rank reads and the range of it, in elements from the piece's start: a
        peer sends only that range (a rank joining a run receives its own partition, not the
        old owners' whole pieces that overlap it)."""
        self.got: dict[Key, tuple[torch.Tensor, int]] = {}
        """Each piece read: its values from an element offset on (the range's start)."""
        self.bytes_received = 0

    def reader(self, fname: str) -> ShardReader:
        raise RuntimeError("a memory-tier source has no files")

    def _plan(self, name: str, a: int, b: int, kinds: Optional[set[str]]) -> None:
        for p in self.overlapping(name, a, b):
            owner = int(p["file"].split("-")[1])
            lo, hi = max(a, p["start"]) - p["start"], min(b, p["stop"]) - p["start"]
            for k in p["keys"]:
                if kinds is None or k in kinds:
                    self.need((owner, name, p["start"], k), lo, hi)

    def need(self, key: Key, lo: int = 0, hi: Optional[int] = None) -> None:
        """Plans elements ``[lo, hi)`` of ``key`` (None: to its end), joined with what is planned."""
        hi = self.where[key][2] if hi is None else hi
        if key in self.needed:
            lo, hi = min(lo, self.needed[key][0]), max(hi, self.needed[key][1])
        self.needed[key] = (lo, hi)

    def _slice(self, key: Key) -> torch.Tensor:
        dtype, off, n = self.where[key]
        return self.local[key[0]][off:off + n * dtype.itemsize].view(dtype)

    def read_planned(self) -> None:
        me, world = self.comm.rank, self.comm.world_size
        asks: dict[int, list[tuple[Key, int, int]]] = {}
        for key, (lo, hi) in sorted(self.needed.items()):
            asks.setdefault(self.servers[key[0]], []).append((key, lo, hi))
        everyone = self.comm.all_gather_object(asks) if world > 1 else [asks]
        works, inbox = [], []
        group = self.comm.group
        glob = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
        for r in range(world):
            if r == me:
                continue
            wanted = everyone[r].get(me, [])
            if wanted:  # this rank serves those pieces: one message per asking rank
                out = torch.cat([self._slice(k)[lo:hi].view(torch.uint8) for k, lo, hi in wanted])
                works.append(dist.isend(out, glob(r), group=self.comm.group))
            mine = asks.get(r, [])
            if mine:
                sizes = [(hi - lo) * self.where[k][0].itemsize for k, lo, hi in mine]
                buf = torch.empty(sum(sizes), dtype=torch.uint8)
                works.append(dist.irecv(buf, glob(r), group=self.comm.group))
                inbox.append((mine, sizes, buf))
        if kill_points.ARMED is not None:  # (fault tests only: Note [kill points])
            kill_points.hit("recovery", self.step)
        for w in works:
            if w is not None:
                w.wait()
        for key, _lo, _hi in asks.get(me, []):
            self.got[key] = (self._slice(key), 0)  # (in this rank's memory: all of it, no copy)
        for keys, sizes, buf in inbox:
            self.bytes_received += buf.numel()
            off = 0
            for (key, lo, _hi), n in zip(keys, sizes):
                self.got[key] = (buf[off:off + n].view(self.where[key][0]), lo)
                off += n
        self.needed.clear()

    def _fetch(self, name: str, a: int, b: int, kind: str) -> Optional[torch.Tensor]:
        parts = []
        for p in self.overlapping(name, a, b):
            if kind not in p["keys"]:
                return None
            got = self.got.get((int(p["file"].split("-")[1]), name, p["start"], kind))
            if got is None:
                return None
            t, base = got
            parts.append(t[max(a, p["start"]) - p["start"] - base:min(b, p["stop"]) - p["start"] - base])
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def release(self, defer: bool = False) -> None:
        self.got.clear()


def _choose(held: list[list[tuple]], world: int) -> Optional[tuple[int, int, dict[int, int]]]:
    """(step, saved world size, owner -> serving rank) of the newest covered step, or None.
    ``held[r]``: (node, owner, step, world_size) rank r can read."""
    cover: dict[tuple[int, int], dict[int, list[int]]] = {}
    for r, items in enumerate(held):
        for _node, owner, step, n in items:
            cover.setdefault((step, n), {}).setdefault(owner, []).append(r)
    for (step, n), owners in sorted(cover.items(), reverse=True):
        if all(o in owners for o in range(n)):
            return step, n, {o: sorted(set(owners[o]))[o % len(set(owners[o]))] for o in range(n)}
    return None


def missing_report(held: list[list[tuple]]) -> str:
    """Which owners' pieces the newest step lacks (for the fallback's log line)."""
    steps: dict[tuple[int, int], set[int]] = {}
    for items in held:
        for _node, owner, step, n in items:
            steps.setdefault((step, n), set()).add(owner)
    if not steps:
        return "no valid memory-tier slot on any node"
    (step, n), owners = max(steps.items())
    return (f"step {step}: the pieces of rank(s) {sorted(set(range(n)) - owners)} are in no tier "
            "(their own slot and their buddy's replica are both gone, torn or refused)")


def recover(tier: MemoryTier, model: Optional[nn.Module], opt: "ZeroOptimizer", scheduler: object, dataloader: object, load_rng: bool,
            disk_step: Optional[int]) -> tuple[Optional[dict], str]:
    """Loads the newest step the tiers cover if it is at least ``disk_step``; (info, "") or
    (None, why the disk is used instead). A collective of the optimizer's group."""
    tier.wait()
    comm = tier.comm
    held_objects = _held(model, opt)
    digest = digest_of(model, opt)[0]
    found, refused = local_slots(tier.root, tier.run_id, digest)
    for why in refused:
        warnings.warn(f"memory tier slot refused, not loaded: {why}", stacklevel=3)
    node = (socket.gethostname(), os.path.realpath(tier.root))
    bad: set[str] = set()
    gather = (lambda x: comm.all_gather_object(x)) if comm.world_size > 1 else (lambda x: [x])
    # A lost member's slot rebuilt from its parity group first (Note [parity memory tier]),
    # whatever redundancy this run now has: the tiers may have been written with parity.
    rebuilt, parity_why = parity_rebuild.rebuild(tier, found, digest, gather)
    if rebuilt:
        found = local_slots(tier.root, tier.run_id, digest)[0]
    while True:
        usable = [s for s in found if s.path not in bad]
        held = gather([(node, s.stamp["owner"], s.step, s.stamp["world_size"]) for s in usable])
        chosen = _choose(held, comm.world_size)
        if chosen is None:
            return None, parity_why or missing_report(held)
        step, n, servers = chosen
        if disk_step is not None and disk_step > step:
            return None, f"the disk holds a newer step ({disk_step}) than the memory tiers ({step})"
        local: dict[int, torch.Tensor] = {}
        headers: dict[int, dict] = {}
        where: dict[Key, tuple[torch.dtype, int, int]] = {}
        problem = None
        for owner in [o for o, r in servers.items() if r == comm.rank]:
            info = next(s for s in usable if s.stamp["owner"] == owner and s.step == step and s.stamp["world_size"] == n)
            try:
                header, data = slots.read(info)
                local[owner] = data
                _entries(owner, header, data.numel())
                headers[owner] = header
            except (OSError, ValueError, KeyError, TypeError) as exc:
                problem = info.path
                warnings.warn(f"memory tier slot skipped: {exc}", stacklevel=3)
                break
        problems = [p for p in gather(problem) if p]
        if problems:
            bad |= set(problems)  # a torn slot: try again without it (its other copy, or an older step)
            continue
        break
    merged: dict[int, dict] = {}
    for part in gather(headers):
        merged.update(part)
    entries = []
    for o in range(n):
        e, w = _entries(o, merged[o], local[o].numel() if o in local else 1 << 62)
        entries.append(e)
        where.update(w)
    h0 = merged[0]
    body = {**h0["header"], "tensors": gather_table(entries, h0["shapes"])}
    body["trainer"] = {**body.get("trainer", {}), "dataloader": [merged[o]["dataloader"] for o in range(n)]}
    where_name = f"memory tier step {step}"
    error, plan, src, residuals = None, None, None, []
    try:
        check_compatible(body, model, opt, where_name, held_objects)
        check_state_kinds(body, model, opt, where_name)
        src = MemorySource(body, comm, servers, local, where, step)
        mine = merged[comm.rank].get("residuals", {}) if comm.rank in merged else {}
        residuals = codec_residuals.applicable(opt, sorted(mine), n == comm.world_size, comm.rank)
        for k in residuals:  # (sent with the pieces)
            src.need((comm.rank, k, 0, RESIDUAL))
        read_phase(src, model, opt)
        plan = trainer_state.prepare(body, opt, scheduler, dataloader, where_name, comm.rank, comm.world_size,
                                     load_rng, held_objects[1], rng_states=[merged[o]["rng"] for o in range(n)])
    except (CheckpointError, ValueError, TypeError, KeyError) as exc:
        error = f"rank {comm.rank}: {exc}"
    errors = [e for e in gather(error) if e]
    if errors or src is None or plan is None:
        return None, f"the memory tiers' step {step} could not be loaded ({errors[0] if errors else 'incomplete'})"
    failed, undo = trainer_state.apply(plan, opt, scheduler, dataloader)
    refused_apply = [e for e in gather(failed) if e]
    if refused_apply:
        if failed is None:
            undo()
        return None, f"the memory tiers' step {step}: a live object refused its state ({refused_apply[0]})"
    apply_phase(src, model, opt)
    codec_residuals.load(opt, {k: src.got[(comm.rank, k, 0, RESIDUAL)][0] for k in residuals})
    src.release()
    state_restored(opt, step)
    # ("bytes_read" is the disk's: this path opens no checkpoint file; the recovery tests count
    # the files opened with an audit hook rather than trust this field.)
    return {"step": step, "path": f"memory:{tier.root}", "source": "memory", "extra": plan.extra, "skipped": [],
            "world_size": n, "stage": body["stage"], "resharded": n != comm.world_size or body["stage"] != opt.stage,
            "rng_restored": plan.rng is not None, "bytes_read": 0,
            "bytes_received": src.bytes_received}, ""
