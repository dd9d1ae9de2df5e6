"""``MemoryTier``: each rank's committed training state in node-local shared memory, replicated
to a buddy rank. Lifecycle: built with the engine (``redundancy="peer"``) -> ``commit`` per step
(copy, checksum, stamp and replicate on a thread; the next step waits for the copy only) -> ``wait`` -> (``disabled`` after a write failed).

Note [peer memory tier]:
What is committed when. ``zeroshard.memory_checkpoint(step, ...)`` is called where a disk
save would be (after ``opt.step(); sched.step()``); every ``every``-th step (``every="auto"``,
the default: every step while that costs <= 5% of a step, else every K-th, the same steps on
every rank, Note [commit pacing] in zeroshard/resilience/commit_pacer.py) it captures what a
disk checkpoint of that step holds (the same ``_capture``: owned pieces of parameters, fp32
masters, moments and step counts; the scheduler, loss scaler, per-rank data position and RNG;
rank 0's buffers; the small state encoded now; with a gradient codec's error feedback, this
rank's residuals, copied now since the next backward changes them before the next step waits
for the tier: zeroshard/checkpoint/codec_residuals.py) and hands the tensors to a thread. The
thread (a) copies them straight into this rank's own slot, ``<root>/rank-<r>/own/slot-{0,1}``
(each slot's data file reserved with fallocate — a full tmpfs says ENOSPC there, where a store
through a mapping would SIGBUS — and mapped once for the run), the one pass over the state
the training loop may wait for: ``ZeroOptimizer.step`` (and ``load_state_dict``,
``load_checkpoint``) waits for that copy (``engine.settled()`` -> ``copied``) before changing the state, so the copy
overlaps the next step's forward and backward; (b) the checksum of the slot's data, in the same
pass as the copy where the CRC-32C kernel loads (Note [slot checksum] in
zeroshard/resilience/checksum.py; else a crc32 pass after it), and (c)
swaps it with the ring over a side gloo group: rank r sends to its buddy (r + 1 mod world on
one node; over nodes the same local rank on the next node, r + LOCAL_WORLD_SIZE) and receives
from the rank whose buddy it is straight into the mapped
``<root>/rank-<r>/replica-<source>/slot-{0,1}`` (on one node, from the owner's slot file:
Note [replica by file]), while stamping its own slot; last (d) the
ranks all-gather any write failure over the side group. No staging buffer: a slot that is not
a regular file (no mapping) takes a buffer in process memory, written by ``write``. Code
that changes the state otherwise between ``memory_checkpoint`` and the next step waits too:
``load_state_dict`` on the model or any of its modules by a pre-hook (``guard``, registered
by ``memory_checkpoint``), ``opt.close()`` by waiting for the whole commit; a hand write to the
parameters (under ``torch.no_grad``) cannot be seen and calls
``opt.engine.memory_tier.copied()`` first. The next commit waits for the thread. A slot
write removes the stamp of the older slot first and writes it last (checksum of header and
data, run id, model digest, step, world size, owner): a kill at any point of the copy leaves
the other slot, with the previous step, valid.
Who holds which copy. After commit k completes, rank r's state of step k is in r's own slot
(on r's node) and in its buddy's replica slot (on the next node), and step k - every in the
other slots. Losing one node loses one copy of each of its ranks' states and one copy of the
states its ranks kept for others; the ring puts the other copy on another node, so a single
node loss (or any loss that does not take a rank and its buddy) is covered.
What is lost when. A kill before a step's commit thread finished on every rank loses that
step: recovery takes the newest step every owner's pieces are covered for (own or replica
slot, checksums verified), i.e. the previous commit. Losing a rank and its buddy (two
adjacent ring members; both copies) loses the memory state: recovery falls back to the disk
checkpoint with one log line naming the ranks whose pieces are gone. A full tmpfs (or any
write error) disables the tier on every rank at the next commit, with a warning: training
and disk saves continue. A tier from another run or model (run id / digest in the stamp) is
refused with a warning and never loaded.
A SIGKILL inside a step, by where it lands (seeded in tests and the benchmark: Note [kill
points] in zeroshard/testing/kill_points.py; bitwise against a disk resume of the step recovered,
docs/results.md): in the forward or the backward's reductions it loses the step in flight, and
the previous step too when that step's commit thread (which overlaps them) had not finished on
every rank; in the optimizer step, after some units moved, the same: the half-applied state
dies with the process (the step waits for the copy before it changes anything); in the commit's
copy or replica swap it loses that commit's step (the torn slot is the older one; the other
keeps the previous step, own and replica); in a disk save after the commit, nothing.
Recovery (zeroshard/checkpoint/memory_recovery.py) needs no disk: the ranks agree on the step from what each node's
slots hold, the rank chosen to serve each owner's slot verifies its checksum, and each rank
receives exactly the pieces overlapping its new partition over the process group; loading
them is ``load_checkpoint``'s own read/apply phases (N -> M reshard) fed from memory. Gradient
residuals are each rank's own: at the same world size rank r takes owner r's (sent with the
pieces when another rank serves that slot), as a disk resume does; at another world size, or
another codec, they start at zero with the disk path's warning.
Not covered yet: NVMe offload, tp/pp/hybrid meshes (refused at construction). Survivors keeping
their processes: Note [in-process recovery] in zeroshard/train/in_process.py. XOR parity
instead of the replica: Note [parity memory tier] in zeroshard/resilience/parity.py.

Note [replica by file]:
Over loopback gloo a replica cost a commit more than anything else (profile in docs/results.md:
the swap 125-230 ms of a 100 MB state, two kernel copies and the TCP stack per direction, against
~25 ms for a copy with its checksum). When a rank's buddy has the same tier root on the same boot
of the same machine (gathered once at construction: boot id, device and inode of the root), the
owner sends only the meta (its stamp, checksum and which of its own slots holds the step) and
the buddy copies the data from the owner's ``own/slot-*/data.bin`` into its replica slot, checking
it against the owner's checksum in the same pass (``slots.copy_data``); a mismatch or a missing
file is a write failure (not stamped; the tier turns off at the next commit, with the warning).
The replica is still a separate copy in the buddy's directory, stamped last; the owner's slot
is complete before its meta is sent and is rewritten only two commits later, after this
commit's all-gather, which the buddy reaches after its copy. The buddy builds the path from its
root, the source rank and a slot name checked against ``slots.SLOTS``. Different roots (two
launchers as two nodes), a slot not mapped, and a handoff use the network as before.
"""
from __future__ import annotations

import atexit
import datetime
import errno
import json
import os
import shutil
import threading
import weakref
import warnings
from typing import Callable, Optional

import torch
import torch.distributed as dist

from zeroshard.comm import Comm
from zeroshard.resilience import checksum, parity, slots, stale_slots
from zeroshard.resilience.commit_pacer import CommitPacer
from zeroshard.resilience.redundancy_options import PeerRedundancy
from zeroshard.testing import kill_points

ALIGN = 64
"""Byte alignment of each tensor in a slot's data (any dtype's view stays aligned)."""


def _join_at_exit(ref: "weakref.ref[MemoryTier]") -> None:
    tier = ref()
    thread = tier._thread if tier is not None else None
    if thread is not None:
        thread.join()


def _next_staying(rank: int, world: int, leaving: list[bool]) -> Optional[int]:
    """The first staying rank after ``rank`` along the ring (then in rank order), or None."""
    step = ring(0, world)[0] or 1
    order = [(rank + i * step) % world for i in range(1, world)] + list(range(world))
    return next((r for r in order if not leaving[r]), None)


def ring(rank: int, world: int) -> tuple[int, int]:
    """(buddy this rank sends to, source it receives from): over nodes the same local rank on
    the next node, on one node the next rank."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world) or world)
    step = local if 0 < local < world and world % local == 0 else 1
    return (rank + step) % world, (rank - step) % world


class MemoryTier:
    def __init__(self, options: PeerRedundancy, comm: Comm) -> None:
        self.options, self.comm = options, comm
        self.rank, self.world = comm.rank, comm.world_size
        self.root, self.run_id = options.root, options.resolved_run_id
        self.buddy, self.source = ring(self.rank, self.world)
        self.parity_group: Optional[list[int]] = (parity.group_of(self.rank, self.world, options.parity)
                                                  if options.parity is not None else None)
        """``PeerRedundancy(parity=g)``: this rank's parity group, instead of a buddy (Note [parity memory tier])."""
        self.disabled: Optional[str] = None
        self.committed: Optional[int] = None
        """The newest step this rank's commit thread finished (own slot written, replica swapped)."""
        self._thread: Optional[threading.Thread] = None
        self._copy_done: Optional[threading.Event] = None
        self._error: Optional[BaseException] = None
        self._write_failed: Optional[str] = None
        self._failed: list[str] = []
        """Every rank's write failure of the last commit, agreed on by its thread."""
        self._pruned = False
        """Whether the earlier worlds' slots were removed (after this tier's first commit that
        every rank finished: Note [stale slots])."""
        self._maps: dict[str, slots.Mapped] = {}
        """Each slot's data file, mapped once and refilled at every commit into that slot."""
        self._staging: Optional[torch.Tensor] = None
        self._received: Optional[torch.Tensor] = None
        self._side: Optional[dist.ProcessGroup] = None
        self._guarded: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
        """The modules whose ``load_state_dict`` waits for the copy in flight (``guard``)."""
        self._algorithm = checksum.preferred()
        """The slots' checksum, parity slots' too (Note [slot checksum])."""
        self.pacer = (CommitPacer(options.auto_budget, options.max_every) if options.paced else None)
        """``every="auto"``: which steps commit (Note [commit pacing])."""
        self._proposal: Optional[tuple[int, float, float]] = None
        self._proposals: Optional[list] = None
        """Every rank's pacing proposal, gathered by the last commit's thread (``every="auto"``)."""
        self._last: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        """(meta, data) of the last commit's own slot as the buddy got them: what a handoff sends."""
        # The last commit's thread may still be writing or swapping as the script ends: the
        # interpreter waits for it (a gloo send cut off by finalization aborts the process).
        atexit.register(_join_at_exit, weakref.ref(self))
        if self.world > 1:  # (a collective of the group: every rank builds its tier)
            timeout = datetime.timedelta(seconds=float(os.environ.get("ZEROSHARD_PG_TIMEOUT", "1800")))
            self._side = dist.new_group(ranks=dist.get_process_group_ranks(comm.group), backend="gloo", timeout=timeout)
        self._shares: list[bool] = self._same_tmpfs()
        """Per rank: whether its tier root is this rank's (same boot, same directory): its buddy
        copies a replica from its own slot's file instead of over the network (Note [replica by file])."""

    def _same_tmpfs(self) -> list[bool]:
        """Which ranks' tier roots are this rank's directory on this boot of this machine (a
        collective of the side group, once; Note [replica by file])."""
        try:
            os.makedirs(self.root, exist_ok=True)
            st = os.stat(self.root)
            with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
                mine: Optional[tuple] = (f.read().strip(), st.st_dev, st.st_ino)
        except OSError:
            mine = None  # (no way to tell: the replica goes over the network)
        keys: list = [mine]
        if self._side is not None:
            keys = [None] * self.world
            dist.all_gather_object(keys, mine, group=self._side)
        return [mine is not None and k == mine for k in keys]

    @property
    def own_dir(self) -> str:
        return os.path.join(self.root, f"rank-{self.rank}", "own")

    @property
    def parity_dir(self) -> str:
        return os.path.join(self.root, f"rank-{self.rank}", "parity")

    @property
    def replica_dir(self) -> str:
        return os.path.join(self.root, f"rank-{self.rank}", f"replica-{self.source}")

    # -- lifecycle -------------------------------------------------------------------------
    def wait(self) -> None:
        """Blocks until the commit in flight is written and replicated; raises its error once."""
        thread = self._thread
        if thread is not None:  # (cleared after the join: a second waiter, e.g. close() on another thread, waits too)
            thread.join()
            if self._thread is thread:
                self._thread = None
        err, self._error = self._error, None
        if err is not None:
            raise RuntimeError(f"the memory tier's commit failed: {err}") from err

    def ready(self, step: int, force: bool = False) -> bool:
        """Whether step ``step`` is to be committed (every ``every``-th, or the pacer's due step,
        or ``force``: a handoff): waits for the previous commit, whose thread agreed with every
        rank whether some write failed (then the tier turns off, with a warning) and, under
        ``every="auto"``, on the next gap (Note [commit pacing])."""
        pacer = self.pacer
        if pacer is not None and not force:
            pacer.tick()
        if self.disabled is not None or not (force or (pacer.due(step) if pacer is not None
                                                       else step % int(self.options.every) == 0)):
            return False
        self.wait()
        proposals, self._proposals = self._proposals, None
        if pacer is not None and proposals is not None:
            pacer.agree(proposals)
        if self._failed:
            self.disabled = self._failed[0]
            warnings.warn(f"the memory tier under {self.root!r} is off from step {step}: {self._failed[0]}. Training "
                          "goes on; only the disk checkpoints cover it now (free the tmpfs, or set "
                          "PeerRedundancy(path=...) elsewhere, and restart to have it back)", stacklevel=4)
            self._release()
            return False
        return True

    def commit(self, stamp: dict, header: dict, tensors: list[tuple[int, torch.Tensor]], size: int) -> None:
        """Starts the commit of ``tensors`` (each to its byte offset) with ``header`` on a thread,
        after ``ready``: it copies them straight into this rank's own slot, then checksums, stamps
        and replicates it (Note [peer memory tier]). Until ``copied`` returns the tensors must
        not change: ``ZeroOptimizer.step`` and the loads wait for it."""
        size = max(size, ALIGN)  # (a rank owning nothing still swaps a buffer: every send has its receive)
        stamp = {**stamp, "run_id": self.run_id, "world_size": self.world, "owner": self.rank}
        if self.pacer is not None:  # (its proposal travels with this commit: Note [commit pacing])
            self._proposal = self.pacer.measure()
            self.pacer.started()
            self.pacer.committed(stamp["step"])
            stamp.update(every=self.pacer.every, commit_cost=self.pacer.cost)
        self._copy_done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(stamp, header, tensors, size, self._copy_done),
                                        name="zeroshard-memory-tier", daemon=True)
        self._thread.start()

    def guard(self, model: torch.nn.Module) -> None:
        """Makes ``load_state_dict`` on ``model`` or any of its modules wait for the copy in flight
        (``copied``) before it writes: a load between ``memory_checkpoint`` and the next step
        would otherwise change the state the copy is reading (once per module; the hook holds
        the tier weakly)."""
        if model in self._guarded:
            return
        ref = weakref.ref(self)

        def wait_for_copy(*_args: object, **_kw: object) -> None:
            tier = ref()
            if tier is not None:
                tier.copied()
        for m in model.modules():
            if m not in self._guarded:
                m.register_load_state_dict_pre_hook(wait_for_copy)
                self._guarded.add(m)

    def copied(self) -> None:
        """Blocks until the commit in flight holds its copy of the state (the state may change then)."""
        done = self._copy_done
        if done is not None:
            done.wait()

    def _target(self, directory: str, size: int) -> tuple[Optional[str], torch.Tensor]:
        """(slot to stamp, or None after a failure; the ``size`` bytes to fill): the older slot of
        ``directory`` mapped, else (not a regular file) a reused in-memory buffer written by ``write``."""
        slot: Optional[str] = None
        if self._write_failed is None:
            try:
                slot = slots.begin(directory)
                mapped = self._maps.get(slot)
                if mapped is None or not mapped.current(size):
                    self._maps.pop(slot, None)
                    mapped = self._maps[slot] = slots.Mapped(slot, size)
                return slot, mapped.tensor
            except OSError as exc:
                if exc.errno != errno.ENOTSUP or slot is None:
                    self._fail(directory, exc)
                    slot = None
        buffers = self._staging if directory == self.own_dir else self._received
        if buffers is None or buffers.numel() != size:
            buffers = torch.empty(size, dtype=torch.uint8)
            if directory == self.own_dir:
                self._staging = buffers
            else:
                self._received = buffers
        return slot, buffers

    def _fail(self, directory: str, exc: Exception) -> None:
        """Records a write error (a full tmpfs: ENOSPC); the ranks agree on it at the commit's end."""
        if self._write_failed is None:
            self._write_failed = f"writing {directory!r} failed ({getattr(exc, 'strerror', None) or exc})"
        for name in slots.SLOTS:  # the torn slot's bytes are given back; the other stays valid
            partial = os.path.join(directory, name)
            if slots.read_stamp(partial) is None:
                self._maps.pop(partial, None)
                shutil.rmtree(partial, ignore_errors=True)

    def _release(self) -> None:
        self._maps.clear()
        self._staging = self._received = None

    def _stamp(self, directory: str, slot: Optional[str], stamp: dict, raw: bytes, buf: torch.Tensor,
               crc: int) -> None:
        if slot is None or self._write_failed is not None:
            return
        try:
            if self._maps.get(slot) is None:  # (not mapped: the data goes by write)
                slots.write_data(slot, buf.numpy().data)
            slots.finish(slot, stamp, raw, buf.numel(), crc)
        except OSError as exc:
            self._fail(directory, exc)

    def _run(self, stamp: dict, header: dict, tensors: list[tuple[int, torch.Tensor]], size: int,
             copy_done: threading.Event) -> None:
        try:
            try:
                slot, buf = self._target(self.own_dir, size)
                # (the checksum in the same pass where the kernel loads, Note [slot checksum]; once:
                # the buddy stores the owner's checksum with its replica)
                after_each = None
                if kill_points.ARMED is not None:  # (fault tests only: Note [kill points])
                    step = stamp["step"]
                    after_each = lambda: kill_points.hit("replica_copy", step)  # noqa: E731
                crc = checksum.copy_in(self._algorithm, buf, tensors, after_each=after_each)
            finally:
                copy_done.set()  # (the next optimizer step may change the state from here)
            del tensors
            raw = json.dumps(header, separators=(",", ":")).encode()
            stamp = {**stamp, "checksum": self._algorithm}
            meta = torch.frombuffer(bytearray(json.dumps({"stamp": stamp, "data_crc32": crc, "slot": os.path.basename(
                slot or "")}).encode() + b"\0" + raw),
                                    dtype=torch.uint8)
            self._last = None
            swap = None
            if self._side is not None and self.parity_group is None:  # the replica travels while this rank stamps its own slot
                swap = self._exchange(meta, buf, self.buddy, self.source, self.replica_dir,
                                      by_file=self._shares[self.buddy] and slot is not None and slot in self._maps)
            self._stamp(self.own_dir, slot, stamp, raw, buf, crc)
            if kill_points.ARMED is not None:  # (fault tests only: the replica swap in flight)
                kill_points.hit("replica_copy", stamp["step"])
            if self._side is not None and self.parity_group is not None:
                self._parity(stamp, raw, buf, crc)
            gathered: list = [(self._write_failed, self._proposal)]
            if swap is not None:
                self._keep(*swap())
            if self._side is not None:  # every rank learns of any write failure (off together) and of every
                gathered = [None] * self.world  # rank's pacing proposal (one K everywhere): parity groups too
                dist.all_gather_object(gathered, (self._write_failed, self._proposal), group=self._side)
            self._failed = [f"rank {r}: {f}" for r, (f, _) in enumerate(gathered) if f]
            self._proposals = [p for _, p in gathered]
            self.committed = stamp["step"]
            if not self._pruned and not self._failed:
                self._pruned = True  # (every rank finished this commit: the gather above)
                first = self._shares.index(True) == self.rank if True in self._shares else False
                keep = {"own", f"replica-{self.source}"} | ({"parity"} if self.parity_group is not None else set())
                stale_slots.prune(self.root, self.rank, self.world, keep, first, self.run_id)
            self._last = (meta, buf)
        except BaseException as exc:  # noqa: BLE001 - raised by the next wait()
            self._error = exc
        finally:
            if self.pacer is not None:
                self.pacer.finished()

    def _parity(self, stamp: dict, raw: bytes, buf: torch.Tensor, crc: int) -> None:
        """The group's XOR parity of this commit into this rank's parity slot (Note [parity memory tier])."""
        if self._side is None or self.parity_group is None:
            raise RuntimeError("the memory tier keeps parity only between ranks of a process group")
        held: list[tuple[Optional[str], torch.Tensor]] = []

        def target(size: int) -> torch.Tensor:
            held.append(self._target(self.parity_dir, size))
            return held[0][1]
        meta = {"stamp": stamp, "data_crc32": crc, "data_bytes": buf.numel(), "header": raw.decode()}
        size, metas = parity.exchange(self._side, self.rank, self.parity_group, buf, meta, target)
        pslot, pbuf = held[0]
        praw = json.dumps({"members": metas}, separators=(",", ":")).encode()
        self._stamp(self.parity_dir, pslot, {**stamp, "parity_group": self.parity_group,
                                             "stripe": self.parity_group.index(self.rank), "chunk": size},
                    praw, pbuf, checksum.of(self._algorithm, pbuf))

    def _keep(self, got_meta: Optional[torch.Tensor], got_slot: Optional[str], got_data: Optional[torch.Tensor],
              directory: str) -> None:
        """Stamps a received replica (its meta: the owner's stamp, data checksum and header)."""
        if got_meta is None or got_data is None:
            return
        head, _, got_raw = bytes(got_meta.numpy()).partition(b"\0")
        theirs = json.loads(head)
        self._stamp(directory, got_slot, theirs["stamp"], got_raw, got_data, theirs["data_crc32"])

    def _exchange(self, meta: Optional[torch.Tensor], data: Optional[torch.Tensor], to: Optional[int],
                  frm: Optional[int], directory: str, by_file: bool = False) -> Callable[[], tuple[
                      Optional[torch.Tensor], Optional[str], Optional[torch.Tensor], str]]:
        """Starts sending (meta, data) to rank ``to`` and receiving rank ``frm``'s over the side
        group (either may be None), the data straight into the older slot of ``directory``; the
        returned function waits for both and gives what was received (its meta, its slot or
        None, its data, ``directory``). ``by_file``: ``data`` is this commit's own slot, which
        ``to`` can read (``_shares``): only the meta is sent (Note [replica by file])."""
        group = self._side
        if group is None:
            raise RuntimeError("the memory tier swaps replicas only between ranks of a process group")
        to_g = dist.get_global_rank(group, to) if to is not None else None
        frm_g = dist.get_global_rank(group, frm) if frm is not None else None
        works: list = []
        sizes = None
        if to_g is not None and meta is not None and data is not None:
            sizes = torch.tensor([meta.numel(), data.numel(), int(by_file)], dtype=torch.int64)
            works.append(dist.isend(sizes, to_g, group=group))
        theirs = torch.empty(3, dtype=torch.int64)
        if frm_g is not None:
            got_sizes = dist.irecv(theirs, frm_g, group=group)
            if got_sizes is not None:
                got_sizes.wait()
        slot, into, got = None, None, None
        if frm_g is not None:
            slot, into = self._target(directory, int(theirs[1]))
            got = torch.empty(int(theirs[0]), dtype=torch.uint8)
            works.append(dist.irecv(got, frm_g, group=group, tag=1))
            if not theirs[2]:
                works.append(dist.irecv(into, frm_g, group=group, tag=2))
        if to_g is not None and meta is not None and data is not None:
            works.append(dist.isend(meta, to_g, group=group, tag=1))
            if not by_file:
                works.append(dist.isend(data, to_g, group=group, tag=2))
        sizes_kept = [sizes, meta, data]

        def finish() -> tuple[Optional[torch.Tensor], Optional[str], Optional[torch.Tensor], str]:
            for w in works:
                if w is not None:
                    w.wait()
            del sizes_kept[:]  # (kept alive until the sends are done)
            if frm is not None and got is not None and into is not None and theirs[2]:
                try:
                    self._copy_replica(frm, got, into)
                except (OSError, ValueError) as exc:  # (not stamped: the tier turns off at the next commit)
                    self._fail(directory, exc)
            return got, slot, into, directory
        return finish

    def _copy_replica(self, frm: int, meta: torch.Tensor, into: torch.Tensor) -> None:
        """Copies rank ``frm``'s own slot of this commit (named in ``meta``) from its file into
        ``into``, checking it against the owner's checksum in the same pass (Note [replica by file])."""
        head = json.loads(bytes(meta.numpy()).partition(b"\0")[0])
        name = head.get("slot")
        if name not in slots.SLOTS:  # (the path is built here, never taken from the message)
            raise ValueError(f"rank {frm} named no slot of its own ({name!r}) for a replica by file")
        path = os.path.join(self.root, f"rank-{frm}", "own", name)
        crc = slots.copy_data(path, into, head["stamp"].get("checksum", checksum.CRC32))
        if crc != head["data_crc32"]:
            raise ValueError(f"{path}: the replica read from rank {frm}'s slot does not match its checksum")

    def hand_over(self, leaving: bool) -> tuple[list[int], list[tuple[int, int]]]:
        """A handoff after the commit of the agreed step (a collective of the side group; Note
        [preemption handoff] in zeroshard/checkpoint/memory_handoff.py): the ranks gather which
        of them leave; each leaving rank whose buddy leaves too (under parity: each the parity
        cannot rebuild, Note [parity memory tier]) sends its last commit's own slot to the next
        staying rank along the ring, which keeps it as a replica. Returns (the
        leaving ranks, the (leaving rank, receiving rank) pairs), the same on every rank."""
        self.wait()
        flags: list[bool] = [leaving]
        if self._side is not None:
            flags = [False] * self.world
            dist.all_gather_object(flags, bool(leaving), group=self._side)
        exposed = (parity.exposed(flags, self.options.parity) if self.options.parity is not None
                   else [r for r in range(self.world) if flags[r] and flags[ring(r, self.world)[0]]])
        pairs = [(r, to) for r in exposed for to in [_next_staying(r, self.world, flags)] if to is not None]
        gone = [r for r in range(self.world) if flags[r]]
        if self._side is None or not pairs:
            return gone, pairs
        if self.disabled is not None or self._last is None:
            raise RuntimeError(f"the memory tier has no commit to hand over ({self.disabled or 'nothing committed'})")
        meta, data = self._last
        for r, to in pairs:  # senders leave and receivers stay: no rank waits on a rank that waits on it
            if self.rank == r:
                self._exchange(meta, data, to, None, self.replica_dir)()
            elif self.rank == to:
                self._keep(*self._exchange(None, None, None, r, os.path.join(
                    self.root, f"rank-{self.rank}", f"replica-{r}"))())
        failed: list[Optional[str]] = [None] * self.world
        dist.all_gather_object(failed, self._write_failed, group=self._side)
        bad = [f"rank {r}: {f}" for r, f in enumerate(failed) if f]
        if bad:
            raise RuntimeError(f"the memory tier's handoff failed: {bad[0]}")
        return gone, pairs

    # -- reports ---------------------------------------------------------------------------
    def report(self) -> dict:
        """The tier's state: its root, the newest committed step, whether it is off, its pacing
        (``every``: the K in use; under "auto" also the measured ``commit_cost`` and ``step_cost``,
        fractions of a step, and the ``budget``: Note [commit pacing]) and ``bytes_held``."""
        pacing = (self.pacer.report() if self.pacer is not None
                  else {"every": self.options.every, "decided": True, "commit_cost": None, "step_cost": None})
        return {"root": self.root, "committed": self.committed, "disabled": self.disabled,
                "auto": self.pacer is not None, **pacing, "bytes_held": self.bytes_held(),
                "parity": self.options.parity, "shard_bytes": slots.data_bytes(self.own_dir),
                "parity_bytes": slots.data_bytes(self.parity_dir)}

    def buffer_bytes(self) -> int:
        """Process memory the tier holds besides its slots: none while the slots are mapped (the
        state is copied straight into them); a buffer per copy whose slot is not a regular file."""
        return sum(b.numel() for b in (self._staging, self._received) if b is not None)

    def bytes_held(self) -> int:
        """Shared memory this rank's slots take (own and replica or parity, two slots each) plus ``buffer_bytes``."""
        return self.buffer_bytes() + slots.slot_bytes(os.path.join(self.root, f"rank-{self.rank}"))
