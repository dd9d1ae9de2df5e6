"""Sequential file I/O that bypasses the page cache (O_DIRECT) where the filesystem allows.

Why: a checkpoint is written once and read once, so the page cache only adds a copy and,
worse, dirty-page throttling: buffered writes of gigabytes stall in ``write()`` at the
kernel's writeback pace and then again in ``fsync``. With O_DIRECT the disk sees large
aligned requests, as ``dd oflag=direct`` (the raw-speed reference of the benchmarks) does.
O_DIRECT needs aligned memory, offsets and sizes: data is copied into aligned staging
buffers (memory bandwidth is several times disk bandwidth) that a writer thread drains while
the caller fills the next one. Filesystems without O_DIRECT (tmpfs) fall back to buffered.
"""
from __future__ import annotations

import os
import queue
import threading
from typing import Optional

import torch

from zeroshard.checkpoint.safe_fs import open_regular
from zeroshard.io.buffers import advise_huge_pages

ALIGN = 4096
_BUF = 16 << 20
_READ = 64 << 20  # bytes per read request: large, as dd bs=64M
_DIRECT = getattr(os, "O_DIRECT", 0)


def aligned_empty(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 tensor whose data starts on an ALIGN boundary."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    off = (-raw.data_ptr()) % ALIGN
    return raw[off:off + nbytes]


def open_direct(path: str, flags: int) -> tuple[int, bool]:
    """``os.open`` with O_DIRECT when the filesystem accepts it; returns (fd, direct)."""
    if _DIRECT and os.environ.get("ZEROSHARD_NO_DIRECT_IO", "0") != "1":
        try:
            return os.open(path, flags | _DIRECT, 0o644), True
        except OSError:  # EINVAL on tmpfs and friends
            pass
    return os.open(path, flags, 0o644), False


class DirectWriter:
    """Writes a byte stream to ``path``; ``close()`` pads, truncates to size and fsyncs."""

    def __init__(self, path: str) -> None:
        self.fd, self.direct = open_direct(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        self.size = 0
        self._free: "queue.Queue[torch.Tensor]" = queue.Queue()
        for _ in range(2):  # double buffering: fill one while the other is written
            # Huge pages: each O_DIRECT write pins its pages, 512x fewer of them (save 2.5 ->
            # 3.4 GB/s here). Not for the reader's buffers: with them the load fell from 2.3
            # to 1.0 GB/s in the same hour (docs/results.md, Checkpoints).
            buf = aligned_empty(_BUF)
            advise_huge_pages(buf)
            self._free.put(buf)
        self._full: "queue.Queue[Optional[tuple[torch.Tensor, int]]]" = queue.Queue()
        self._error: Optional[BaseException] = None
        self._cur = self._free.get()
        self._fill = 0
        self._thread = threading.Thread(target=self._drain, name="zeroshard-writer", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while (item := self._full.get()) is not None:
            buf, n = item
            try:
                if self._error is None:
                    mv = buf.numpy().data[:n]
                    while len(mv):
                        mv = mv[os.write(self.fd, mv):]
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                self._error = exc
            self._free.put(buf)

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def write(self, data: memoryview) -> None:
        self._check()
        data = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        while len(data):
            take = min(len(data), _BUF - self._fill)
            self._cur.numpy().data[self._fill:self._fill + take] = data[:take]
            self._fill += take
            self.size += take
            data = data[take:]
            if self._fill == _BUF:
                self._full.put((self._cur, _BUF))
                self._cur, self._fill = self._free.get(), 0

    def close(self, abort: bool = False) -> None:
        try:
            if self._fill and not abort:
                n = self._fill + (-self._fill % ALIGN if self.direct else 0)
                self._cur.numpy().data[self._fill:n] = b"\0" * (n - self._fill)
                self._full.put((self._cur, n))
            self._full.put(None)
            self._thread.join()
            if not abort:
                self._check()
                os.ftruncate(self.fd, self.size)  # drop the O_DIRECT padding of the tail
                os.fsync(self.fd)
        finally:
            os.close(self.fd)


def read_into(path: str, offset: int, out: torch.Tensor) -> int:
    """Reads ``len(out)`` bytes at ``offset`` into ``out`` (uint8; aligned via aligned_empty
    for the direct path, with room for the tail rounded up to ALIGN); returns bytes read."""
    n = out.numel()
    # Checkpoint files are input: regular files only, never through a link (safe_fs).
    fd, direct = open_regular(path, direct=offset % ALIGN == 0 and out.data_ptr() % ALIGN == 0)
    try:
        mv = out.numpy().data
        got = 0
        while got < n:
            want = min(_READ, n - got)
            if direct:
                want += -want % ALIGN
                view = mv[got:got + want] if got + want <= len(mv) else None
                if view is None:  # the aligned tail overruns ``out``: read it via a bounce buffer
                    bounce = aligned_empty(want)
                    k = os.preadv(fd, [bounce.numpy().data], offset + got)
                    k = min(k, n - got)
                    mv[got:got + k] = bounce.numpy().data[:k]
                else:
                    k = min(os.preadv(fd, [view], offset + got), n - got)
            else:
                k = os.preadv(fd, [mv[got:got + want]], offset + got)
            if k <= 0:
                break
            got += k
        return got
    finally:
        os.close(fd)
