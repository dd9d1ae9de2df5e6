"""``MemoryTier``: each rank's committed training state in node-local shared memory, replicated
to a buddy rank. Lifecycle: built with the engine (``redundancy="peer"``) -> ``commit`` per step
(copy now, write and replicate on a thread) -> ``wait`` -> (``disabled`` after a write failed).

Note [peer memory tier]:
What is committed when. ``zeroshard.memory_checkpoint(step, ...)`` is called where a disk
save would be (after ``opt.step(); sched.step()``); every ``every``-th step it captures what a
disk checkpoint of that step holds (the same ``_capture``: owned pieces of parameters, fp32
masters, moments and step counts; the scheduler, loss scaler, per-rank data position and RNG;
rank 0's buffers) and copies the tensors into one staging buffer on the calling thread — the
only part on the critical path. A thread then (a) writes the buffer into this rank's own slot
pair, ``<root>/rank-<r>/own/slot-{0,1}``, and (b) swaps it with the ring over a side gloo group:
rank r sends to its buddy (r + 1 mod world on one node; over nodes the same local rank on the
next node, r + LOCAL_WORLD_SIZE) and receives from the rank whose buddy it is, writing that into
``<root>/rank-<r>/replica-<source>/slot-{0,1}``. The next commit waits for the thread. A slot
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
Recovery (zeroshard/checkpoint/memory_recovery.py) needs no disk: the ranks agree on the step from what each node's
slots hold, the rank chosen to serve each owner's slot verifies its checksum, and each rank
receives exactly the pieces overlapping its new partition over the process group; loading
them is ``load_checkpoint``'s own read/apply phases (N -> M reshard) fed from memory.
Not covered yet: NVMe offload, tp/pp/hybrid meshes (refused at construction), in-process
recovery (survivors keep their processes; torchrun restarts every worker), XOR parity.
"""
from __future__ import annotations

import atexit
import datetime
import json
import os
import shutil
import threading
import weakref
import warnings
import zlib
from typing import Callable, Optional

import torch
import torch.distributed as dist

from zeroshard.comm import Comm
from zeroshard.resilience import slots
from zeroshard.resilience.options import PeerRedundancy

ALIGN = 64
"""Byte alignment of each tensor in a slot's data (any dtype's view stays aligned)."""


def _join_at_exit(ref: "weakref.ref[MemoryTier]") -> None:
    tier = ref()
    thread = tier._thread if tier is not None else None
    if thread is not None:
        thread.join()


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
        self.disabled: Optional[str] = None
        self.committed: Optional[int] = None
        """The newest step this rank's commit thread finished (own slot written, replica swapped)."""
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._write_failed: Optional[str] = None
        self._staging: Optional[torch.Tensor] = None
        self._side: Optional[dist.ProcessGroup] = None
        # The last commit's thread may still be writing or swapping as the script ends: the
        # interpreter waits for it (a gloo send cut off by finalization aborts the process).
        atexit.register(_join_at_exit, weakref.ref(self))
        if self.world > 1:  # (a collective of the group: every rank builds its tier)
            timeout = datetime.timedelta(seconds=float(os.environ.get("ZEROSHARD_PG_TIMEOUT", "1800")))
            self._side = dist.new_group(ranks=dist.get_process_group_ranks(comm.group), backend="gloo", timeout=timeout)

    @property
    def own_dir(self) -> str:
        return os.path.join(self.root, f"rank-{self.rank}", "own")

    @property
    def replica_dir(self) -> str:
        return os.path.join(self.root, f"rank-{self.rank}", f"replica-{self.source}")

    # -- lifecycle -------------------------------------------------------------------------
    def wait(self) -> None:
        """Blocks until the commit in flight is written and replicated; raises its error once."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        err, self._error = self._error, None
        if err is not None:
            raise RuntimeError(f"the memory tier's commit failed: {err}") from err

    def ready(self, step: int) -> bool:
        """Whether step ``step`` is to be committed: waits for the previous commit, and agrees with
        every rank whether some write failed (then the tier turns off, with a warning)."""
        if self.disabled is not None or step % self.options.every:
            return False
        self.wait()
        failed = self.comm.all_gather_object(self._write_failed) if self.world > 1 else [self._write_failed]
        failed = [f"rank {r}: {f}" for r, f in enumerate(failed) if f]
        if failed:
            self.disabled = failed[0]
            warnings.warn(f"the memory tier under {self.root!r} is off from step {step}: {failed[0]}. Training "
                          "goes on; only the disk checkpoints cover it now (free the tmpfs, or set "
                          "PeerRedundancy(path=...) elsewhere, and restart to have it back)", stacklevel=4)
            return False
        return True

    def commit(self, stamp: dict, header: dict, tensors: list[tuple[int, torch.Tensor]], size: int) -> None:
        """Copies ``tensors`` (at their byte offsets) into the staging buffer now, then writes and
        replicates it with ``header`` on a thread (Note [peer memory tier]); after ``ready``."""
        size = max(size, ALIGN)  # (a rank owning nothing still swaps a buffer: every send has its receive)
        if self._staging is None or self._staging.numel() != size:
            self._staging = torch.empty(size, dtype=torch.uint8)
        buf = self._staging
        with torch.no_grad():
            for off, t in tensors:
                n = t.numel() * t.element_size()
                buf[off:off + n].view(t.dtype).copy_(t.detach().reshape(-1))
        stamp = {**stamp, "run_id": self.run_id, "world_size": self.world, "owner": self.rank}
        self._thread = threading.Thread(target=self._run, args=(stamp, header, buf), name="zeroshard-memory-tier",
                                        daemon=True)
        self._thread.start()

    def _write(self, directory: str, stamp: dict, raw: bytes, data: torch.Tensor, crc: int) -> None:
        if self._write_failed is not None:
            return
        try:
            slots.write(directory, stamp, raw, data.numpy().data, crc)
        except OSError as exc:  # (a full tmpfs: ENOSPC) the others learn it at the next commit
            self._write_failed = f"writing {directory!r} failed ({exc.strerror or exc})"
            for name in slots.SLOTS:  # the torn slot's bytes are given back; the other stays valid
                partial = os.path.join(directory, name)
                if slots.read_stamp(partial) is None:
                    shutil.rmtree(partial, ignore_errors=True)

    def _run(self, stamp: dict, header: dict, buf: torch.Tensor) -> None:
        try:
            raw = json.dumps(header, separators=(",", ":")).encode()
            crc = zlib.crc32(buf.numpy().data)  # (once: the buddy stores the owner's checksum with its replica)
            swap = None
            if self._side is not None:  # the replica travels while this rank writes its own slot
                meta = json.dumps({"stamp": stamp, "data_crc32": crc}).encode() + b"\0" + raw
                swap = self._swap(torch.frombuffer(bytearray(meta), dtype=torch.uint8), buf)
            self._write(self.own_dir, stamp, raw, buf, crc)
            if swap is not None:
                got_meta, got_data = swap()
                head, _, got_raw = bytes(got_meta.numpy()).partition(b"\0")
                theirs = json.loads(head)
                self._write(self.replica_dir, theirs["stamp"], got_raw, got_data, theirs["data_crc32"])
            self.committed = stamp["step"]
        except BaseException as exc:  # noqa: BLE001 - raised by the next wait()
            self._error = exc

    def _swap(self, meta: torch.Tensor, data: torch.Tensor) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        """Starts sending (meta, data) to the buddy and receiving the source's over the side
        group; the returned function waits for both and gives what was received."""
        group = self._side
        if group is None:
            raise RuntimeError("the memory tier swaps replicas only between ranks of a process group")
        to, frm = (dist.get_global_rank(group, r) for r in (self.buddy, self.source))
        sizes = torch.tensor([meta.numel(), data.numel()], dtype=torch.int64)
        theirs = torch.empty(2, dtype=torch.int64)
        for w in (dist.isend(sizes, to, group=group), dist.irecv(theirs, frm, group=group)):
            if w is not None:
                w.wait()
        got = (torch.empty(int(theirs[0]), dtype=torch.uint8), torch.empty(int(theirs[1]), dtype=torch.uint8))
        works = [dist.isend(meta, to, group=group, tag=1), dist.irecv(got[0], frm, group=group, tag=1),
                 dist.isend(data, to, group=group, tag=2), dist.irecv(got[1], frm, group=group, tag=2)]

        def finish() -> tuple[torch.Tensor, torch.Tensor]:
            for w in works:
                if w is not None:
                    w.wait()
            return got
        return finish

    # -- reports ---------------------------------------------------------------------------
    def bytes_held(self) -> int:
        """Shared memory this rank's slots take (own and replica, two slots each) plus its staging buffer."""
        staging = self._staging.numel() if self._staging is not None else 0
        return staging + slots.slot_bytes(os.path.join(self.root, f"rank-{self.rank}"))
