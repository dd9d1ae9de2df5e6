"""Spot checks of swap traffic: the first 8 bytes of every 4 KiB page, kept in memory.

Note [zero-fill detection]: a swap file that is truncated and written again, hole-punched,
or overwritten with zeros reads back as zero pages (file systems lose data a block at a
time). Each write records the 8 bytes that start every page it covers; each read compares
them. A zeroed (or otherwise replaced) page whose first word was not zero is caught; a
change inside a page that leaves its first 8 bytes alone is not: this is a detector of
lost pages, not a checksum. A CRC-32 of all swap traffic would catch any change, but it
costs about as much CPU time as the I/O it checks (``benchmarks/bench_swap_checksum.py``;
the figures are in docs/design.md, Offload), the 8-byte samples cost well under 1% and
1/512 of the file in memory.
"""
from __future__ import annotations

import threading
from typing import Optional

import torch

PAGE = 4096
WORD = 8


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class PageSamples:
    """Expected first words of the pages of one file (``record`` on write, ``verify`` on read)."""

    def __init__(self) -> None:
        self._words = torch.zeros(0, WORD, dtype=torch.uint8)
        self._known = torch.zeros(0, dtype=torch.bool)
        self._lock = threading.Lock()  # a checkpoint save reads from another thread

    def _grow(self, pages: int) -> None:
        if pages <= self._known.numel():
            return
        cap = max(pages, 2 * self._known.numel())
        words = torch.zeros(cap, WORD, dtype=torch.uint8)
        known = torch.zeros(cap, dtype=torch.bool)
        words[:self._words.shape[0]] = self._words
        known[:self._known.numel()] = self._known
        self._words, self._known = words, known

    @staticmethod
    def _pages(offset: int, nbytes: int) -> tuple[int, int]:
        """Pages ``[first, last)`` whose first word lies wholly inside bytes ``[offset, offset+nbytes)``."""
        first = -(-offset // PAGE)
        last = (offset + nbytes - WORD) // PAGE + 1 if nbytes >= WORD else first
        return first, max(first, last)

    @staticmethod
    def _sampled(data: torch.Tensor, offset: int, first: int, last: int) -> torch.Tensor:
        """The ``[last - first, 8]`` first words of those pages, as a strided view of ``data``."""
        b = _byte_view(data)
        return b.as_strided((last - first, WORD), (PAGE, 1), b.storage_offset() + first * PAGE - offset)

    def record(self, offset: int, data: torch.Tensor) -> None:
        """``data`` is being written at byte ``offset``."""
        nbytes = data.numel() * data.element_size()
        if nbytes == 0:
            return
        first, last = self._pages(offset, nbytes)
        with self._lock:
            self._grow(-(-(offset + nbytes) // PAGE))
            if last > first:
                self._words[first:last] = self._sampled(data, offset, first, last)
                self._known[first:last] = True
            # A word the write covers only in part is no longer known.
            for edge in (offset, offset + nbytes):
                page = edge // PAGE
                if edge % PAGE and edge % PAGE < WORD and page < self._known.numel():
                    self._known[page] = False

    def verify(self, offset: int, data: torch.Tensor) -> Optional[int]:
        """The file offset of the first sampled page of ``data`` (just read from ``offset``)
        that differs from what was written there, or None."""
        nbytes = data.numel() * data.element_size()
        first, last = self._pages(offset, nbytes)
        with self._lock:
            last = min(last, self._known.numel())
            if last <= first:
                return None
            known = self._known[first:last]
            bad = (self._sampled(data, offset, first, last) != self._words[first:last]).any(1) & known
            if not bool(bad.any()):
                return None
            return (first + int(bad.nonzero()[0, 0])) * PAGE

    def forget(self) -> None:
        with self._lock:
            self._known.zero_()

    @property
    def nbytes(self) -> int:
        return self._words.numel() + self._known.numel()
