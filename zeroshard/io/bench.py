"""Throughput of ``AsyncIO`` on one directory's disk, a block-size x queue-depth sweep, and a
recommendation. Used by ``zeroshard bench aio`` and ``benchmarks/bench_aio.py``.

Note [what is measured]: a file of ``file_bytes`` is written front to back as consecutive
``chunk_bytes`` requests, all submitted before the first wait (the way offload streams a
layer's state), then read back the same way. O_DIRECT bypasses the page cache, so the read
figure is the disk's, not memory's; with ``use_direct=False`` the caller should drop caches.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from .buffers import aligned_empty
from .aio_engine import AsyncIO

MiB = 1 << 20


@dataclass(frozen=True)
class Point:
    """One measured configuration."""

    backend: str
    block_size: int
    queue_depth: int
    write_gbps: float
    read_gbps: float


def time_passes(path: str, file_bytes: int, chunk: int, write: Callable[[int], object],
                read: Callable[[int], object], wait: Callable[[], object]) -> tuple[float, float]:
    """(write GB/s, read GB/s) of one front-to-back pass each way over a fresh file at ``path``:
    ``write(offset)``/``read(offset)`` submit one ``chunk``, ``wait()`` waits for all submitted.
    Any engine fits (benchmarks/bench_aio.py times DeepSpeed's with it); the file is removed."""
    if file_bytes % chunk:
        raise ValueError(f"file_bytes={file_bytes} must be a multiple of the chunk size {chunk}")
    if os.path.exists(path):
        os.remove(path)  # writes then allocate blocks, as a fresh offload file would
    try:
        t0 = time.perf_counter()
        for off in range(0, file_bytes, chunk):
            write(off)
        wait()
        t1 = time.perf_counter()
        for off in range(0, file_bytes, chunk):
            read(off)
        wait()
        t2 = time.perf_counter()
    finally:
        if os.path.exists(path):
            os.remove(path)
    return file_bytes / (t1 - t0) / 1e9, file_bytes / (t2 - t1) / 1e9


def measure(io: AsyncIO, path: str, file_bytes: int, buffer: torch.Tensor) -> tuple[float, float]:
    """(write GB/s, read GB/s) of ``file_bytes`` at ``path`` through ``io``; see Note [what is measured]."""
    return time_passes(path, file_bytes, buffer.numel() * buffer.element_size(),
                       lambda off: io.pwrite(buffer, path, off), lambda off: io.pread(buffer, path, off), io.wait_all)


def sweep(directory: str, file_bytes: int, block_sizes: Sequence[int], queue_depths: Sequence[int],
          backend: str = "auto", chunk_bytes: int = 256 * MiB,
          progress: Optional[Callable[[Point], None]] = None) -> list[Point]:
    """Measures every (block size, queue depth) once, in that order."""
    chunk_bytes = min(chunk_bytes, file_bytes)
    buffer = aligned_empty(chunk_bytes, torch.uint8, pin=False)
    buffer.random_(0, 256)  # not zeros: some virtual disks and file systems shortcut zero pages
    path = os.path.join(directory, f".zeroshard-bench-aio-{os.getpid()}.dat")
    points = []
    for bs in block_sizes:
        for qd in queue_depths:
            with AsyncIO(block_size=bs, queue_depth=qd, backend=backend) as io:
                w, r = measure(io, path, file_bytes, buffer)
                p = Point(io.backend, bs, qd, w, r)
            points.append(p)
            if progress is not None:
                progress(p)
    return points


def recommend(points: Sequence[Point], tolerance: float = 0.95) -> Point:
    """The cheapest configuration (fewest bytes in flight: block_size x queue_depth, then the
    smaller block) whose write and read are both within ``tolerance`` of the best seen; fewer
    bytes in flight means less pinned memory and lower latency per request for the same speed."""
    if not points:
        raise ValueError("no measurements to recommend from")
    best_w = max(p.write_gbps for p in points)
    best_r = max(p.read_gbps for p in points)
    good = [p for p in points if p.write_gbps >= tolerance * best_w and p.read_gbps >= tolerance * best_r]
    if not good:  # no single point is near both bests: take the best harmonic mean
        return max(points, key=lambda p: 2 / (1 / p.write_gbps + 1 / p.read_gbps))
    return min(good, key=lambda p: (p.block_size * p.queue_depth, p.block_size))
