"""``AIOConfig``: the knobs of one ``AsyncIO`` engine, validated at construction."""
from __future__ import annotations

from dataclasses import dataclass

ALIGN = 4096
"""O_DIRECT alignment of buffers, file offsets and lengths (the logical block size of every
disk we target; 4096 also satisfies 512-byte-sector disks)."""

BACKENDS = ("auto", "native", "kaio", "python")


@dataclass(frozen=True)
class AIOConfig:
    """How ``AsyncIO`` splits and issues requests."""

    block_size: int = 8 << 20
    """Bytes per read/write system call; a request is split into blocks of this size. Must be
    a positive multiple of 4096. ``zeroshard bench aio --path DIR`` recommends one per disk."""
    queue_depth: int = 16
    """Blocks in flight at once (worker threads of the engine)."""
    use_direct: bool = True
    """Open files with O_DIRECT (bypass the page cache). File systems that refuse it (tmpfs)
    get buffered I/O instead, and ``engine_status()`` says so."""
    backend: str = "auto"
    """"auto" (native engine if it loads, else threads in Python), "native" (the native
    thread pool of pread/pwrite), "kaio" (native, Linux kernel AIO from one thread; see Note
    [kernel AIO engine] in csrc/aio/aio_engine.cpp) or "python"."""

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size <= 0 or self.block_size % ALIGN:
            near = max(ALIGN, self.block_size // ALIGN * ALIGN) if isinstance(self.block_size, int) else 8 << 20
            raise ValueError(f"block_size={self.block_size!r} must be a positive multiple of {ALIGN} "
                             f"(O_DIRECT alignment); e.g. block_size={near}")
        if not isinstance(self.queue_depth, int) or not 1 <= self.queue_depth <= 1024:
            raise ValueError(f"queue_depth={self.queue_depth!r} must be an int in [1, 1024]; 8-32 suits NVMe disks")
        if not isinstance(self.use_direct, bool):
            raise TypeError(f"use_direct={self.use_direct!r} must be True or False")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r} must be one of {BACKENDS}")
