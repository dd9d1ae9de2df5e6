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

What it may hold is bounded in two ways, so that a memory budget still means what it says:
- at most ``max_buffers`` buffers (the oldest go first). Within a forward or backward pass
  the pool then holds what was just released and is about to be taken again. Buffers are matched by storage size, so the gradient buckets use the
  same padded storages as swapped parts (Note [aligned swap parts]): at world size 1 a unit's
  gathered parameters, bucket and swapped gradient are then one size, and a buffer released by
  one is taken by the next of any of them;
- ``trim()`` returns everything at the end of each backward pass and of each optimizer step
  (ZeroOptimizer registers it), where the step's staging buffers, or user code, need the
  memory the passes used.
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
    def __init__(self, max_buffers: int = 2) -> None:
        self.max_buffers = max_buffers
        self.enabled = (os.environ.get("ZEROSHARD_HOST_POOL", "1") != "0"
                        and hasattr(torch.UntypedStorage, "_swap_data_ptr_"))
        self._entries: list[tuple[int, torch.UntypedStorage]] = []  # (bytes, holder), oldest first
        self._lock = threading.Lock()
        self.reused = 0
        """Bytes handed out again instead of newly mapped (since start)."""

    @property
    def held(self) -> int:
        """Bytes the pool holds now."""
        with self._lock:
            return sum(n for n, _ in self._entries)

    def _takes(self, t: torch.Tensor) -> bool:
        return self.enabled and t.device.type == "cpu" and not t.is_pinned()

    def release(self, t: torch.Tensor) -> None:
        """Empties ``t``'s storage (every view sees 0 bytes), keeping its memory for reuse."""
        s = t.untyped_storage()
        n = s.nbytes()
        if n < MIN_BYTES or not self._takes(t):
            s.resize_(0)
            return
        holder = torch.UntypedStorage(0)
        holder._swap_data_ptr_(s)  # type: ignore[attr-defined]  # (private torch API; hasattr checked in __init__)
        with self._lock:
            self._entries.append((n, holder))
            del self._entries[:max(0, len(self._entries) - self.max_buffers)]  # (oldest first, freed with their holders)

    def acquire(self, t: torch.Tensor, nbytes: int) -> None:
        """Gives ``t``'s empty storage ``nbytes`` of memory: a pooled buffer of that size if
        there is one (its old contents: like any fresh allocation, it is uninitialised), else
        a new one with huge pages advised (Note [huge pages for unit buffers])."""
        s = t.untyped_storage()
        if s.nbytes() == nbytes:
            return
        holder = None
        if s.nbytes() == 0 and nbytes >= MIN_BYTES and self._takes(t):
            with self._lock:
                for k in range(len(self._entries) - 1, -1, -1):  # (the newest of that size)
                    if self._entries[k][0] == nbytes:
                        holder = self._entries.pop(k)[1]
                        self.reused += nbytes
                        break
        if holder is not None:
            s._swap_data_ptr_(holder)  # type: ignore[attr-defined]  # (private torch API; hasattr checked in __init__)
            return
        s.resize_(nbytes)
        advise_huge_pages(t)

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised 1-D CPU tensor, 4096-aligned in a padded storage like
        ``resizable_aligned``'s, whose memory may come from the pool."""
        raw = torch.empty(0, dtype=torch.uint8)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        self.acquire(raw, padded_bytes(nbytes))
        raw = raw.set_(raw.untyped_storage(), 0, (raw.untyped_storage().nbytes(),), (1,))
        skip = (-raw.data_ptr()) % ALIGN
        return raw[skip:skip + nbytes].view(dtype)

    def trim(self) -> int:
        """Returns every pooled buffer to the system; the bytes returned."""
        with self._lock:
            entries, self._entries = self._entries, []
        return sum(n for n, _ in entries)


HOST_POOL = HostBufferPool()
