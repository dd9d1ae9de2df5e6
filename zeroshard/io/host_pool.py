"""``HOST_POOL``: the memory of released CPU unit buffers, kept for the next buffer of its size.

Note [reused host buffers]: a stage-3 step releases and re-allocates the same buffers all the
time: each unit's gathered parameters twice, its gradient bucket, and under NVMe offload its
swapped parts after every read and write. glibc maps each of those afresh, and the kernel
zeroes every page on first touch: measured with ``perf`` on a CPU-offloaded 12-block model,
``clear_page_erms`` was a third of all CPU time, the fill after it then running at half speed.
The units of one model come in a few sizes, so a buffer just released is the right size for
the next one: ``release`` moves a storage's memory into the pool instead of unmapping it
(``UntypedStorage._swap_data_ptr_``: every view of the storage sees it empty, exactly as after
``resize_(0)``), and ``acquire`` moves it into the next empty storage of that size.

What it may hold is bounded by resident memory: at most ``max_buffers`` times the largest
buffer it was given (the oldest go first; at most ``max_entries`` buffers). A buffer's resident
memory is the pages it was used for, not its storage size: a small swapped part lives in a
32 MiB padded storage (Note [aligned swap parts]) of which it touches its own bytes, so many
small parts fit beside two large gathered buffers. A buffer is handed to the next request of
its size or up to 1/64 larger (a frozen unit's gathered buffer and its padded shard differ by a
few KiB), so at world size 1 a unit's gathered parameters, bucket and swapped gradient share
buffers.

The pool lives across passes and steps, so the buffers backward releases are what the step's
staging and the next forward take: since the fifth session it is no longer emptied after each
backward and step (a 16-block LoRA step had mapped 29 buffers anew, with ~7,400 page faults).
``offload="auto"`` counts what it may hold (Note [what the budget covers] in
zeroshard/planner/auto_placement.py); ``trim()`` returns it all (``ZeroOptimizer.close`` does).
Only plain CPU storages of at least ``MIN_BYTES`` take part (pinned memory has its own caching
allocator; small buffers come from glibc's heap without faults). ``ZEROSHARD_HOST_POOL=0`` turns
it off; released memory then goes back at once, as before.
"""
from __future__ import annotations

import os
import threading

import torch

from .buffers import ALIGN, advise_huge_pages, padded_bytes

MIN_BYTES = 1 << 20


class HostBufferPool:
    def __init__(self, max_buffers: int = 4, max_entries: int = 64) -> None:
        self.max_buffers = max_buffers
        self.max_entries = max_entries
        self.enabled = (os.environ.get("ZEROSHARD_HOST_POOL", "1") != "0"
                        and hasattr(torch.UntypedStorage, "_swap_data_ptr_"))
        self._entries: list[tuple[int, torch.UntypedStorage, int]] = []  # (bytes, holder, resident), oldest first
        self._resident: dict[int, int] = {}  # data_ptr of memory handed out -> the pages it was used for
        self._largest = 0
        self._lock = threading.Lock()
        self._trim_pending = False
        """A ``trim(wait=False)`` found the lock held: the holder trims as it leaves (Note [trim from a finalizer])."""
        self.reused = 0
        """Bytes handed out again instead of newly mapped (since start)."""
        self.mapped = 0
        """Bytes of poolable buffers mapped anew (since start): what reuse did not cover."""

    @property
    def held(self) -> int:
        """Resident bytes the pool holds now (the pages its buffers were used for)."""
        with self._lock:
            return sum(r for _, _, r in self._entries)

    def _takes(self, t: torch.Tensor) -> bool:
        return self.enabled and t.device.type == "cpu" and not t.is_pinned()

    def release(self, t: torch.Tensor) -> None:
        """Empties ``t``'s storage (every view sees 0 bytes), keeping its memory for reuse."""
        s = t.untyped_storage()
        n = s.nbytes()
        if n < MIN_BYTES or not self._takes(t):
            s.resize_(0)
            return
        used = min(n, t.numel() * t.element_size() + ALIGN)  # (a padded storage's untouched pages cost nothing)
        with self._lock:
            resident = max(used, self._resident.pop(s.data_ptr(), 0))
            self._largest = max(self._largest, resident)
        holder = torch.UntypedStorage(0)
        holder._swap_data_ptr_(s)  # type: ignore[attr-defined]  # (private torch API; hasattr checked in __init__)
        with self._lock:
            self._entries.append((n, holder, resident))
            bound = self.max_buffers * self._largest
            while self._entries and (len(self._entries) > self.max_entries
                                     or sum(r for _, _, r in self._entries) > bound):
                del self._entries[0]  # (oldest first, freed with its holder)
        self._trim_if_asked()

    def acquire(self, t: torch.Tensor, nbytes: int) -> None:
        """Gives ``t``'s empty storage ``nbytes`` of memory: a pooled buffer of that size if
        there is one (its old contents: like any fresh allocation, it is uninitialised), else
        a new one with huge pages advised (Note [huge pages for unit buffers])."""
        s = t.untyped_storage()
        if nbytes <= s.nbytes() <= nbytes + (nbytes >> 6):  # (already holds memory that fits)
            return
        holder, resident = None, 0
        pooled = s.nbytes() == 0 and nbytes >= MIN_BYTES and self._takes(t)
        if pooled:
            with self._lock:
                for k in range(len(self._entries) - 1, -1, -1):  # (the newest that fits)
                    if nbytes <= self._entries[k][0] <= nbytes + (nbytes >> 6):
                        _, holder, resident = self._entries.pop(k)
                        self.reused += nbytes
                        break
        if holder is not None:
            s._swap_data_ptr_(holder)  # type: ignore[attr-defined]  # (private torch API; hasattr checked in __init__)
        else:
            s.resize_(nbytes)
            advise_huge_pages(t)
            if pooled:
                self.mapped += nbytes
        if pooled:
            with self._lock:
                if len(self._resident) > 4096:  # (memory freed elsewhere never says so)
                    self._resident.clear()
                self._resident[s.data_ptr()] = resident
        self._trim_if_asked()

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised 1-D CPU tensor, 4096-aligned in a padded storage like
        ``resizable_aligned``'s, whose memory may come from the pool."""
        raw = torch.empty(0, dtype=torch.uint8)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        self.acquire(raw, padded_bytes(nbytes))
        raw = raw.set_(raw.untyped_storage(), 0, (raw.untyped_storage().nbytes(),), (1,))
        skip = (-raw.data_ptr()) % ALIGN
        return raw[skip:skip + nbytes].view(dtype)

    def trim(self, wait: bool = True) -> int:
        """Returns every pooled buffer to the system; the bytes returned (0 when left to the
        lock's holder: ``wait=False``, Note [trim from a finalizer]).

        Note [trim from a finalizer]: an optimizer's teardown empties the pool, and it runs from
        a finalizer when the optimizer is collected, which the garbage collector may do at any
        allocation, including one inside this pool's own critical section on the same thread
        (``release`` building its sum). Waiting for the lock there waited for itself forever
        (a 2-rank job hung in construction, the other rank in the agreement's collective). So a
        finalizer never waits: if the lock is held, the trim is marked and the holder runs it
        as it leaves ``release`` or ``acquire``."""
        if not self._lock.acquire(blocking=wait):
            self._trim_pending = True
            return 0
        try:
            entries, self._entries = self._entries, []
            self._trim_pending = False
        finally:
            self._lock.release()
        return sum(r for _, _, r in entries)

    def _trim_if_asked(self) -> None:
        if self._trim_pending:
            self.trim()


HOST_POOL = HostBufferPool()
