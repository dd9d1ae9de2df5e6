"""How one request becomes block tasks: which descriptors, which blocks may use O_DIRECT.

Note [O_DIRECT and the unaligned tail]: O_DIRECT needs the buffer address, the file offset
and the length to be multiples of 4096. A request whose buffer and offset are aligned sends
its whole 4096-multiple prefix through an O_DIRECT descriptor and only the final partial
page (``nbytes % 4096``) through a buffered descriptor of the same file; the two ranges never
share a page, so the page cache and the direct path never hold different copies of one page.
A request whose buffer or offset is not aligned goes entirely through the buffered
descriptor. File systems that refuse O_DIRECT at open() (tmpfs, some FUSE/network mounts)
get buffered I/O for everything; the refusal is recorded for ``engine_status()``. Both
backends also retry a block through the buffered descriptor if the kernel refuses O_DIRECT
for it (EINVAL), which some file systems do per request rather than at open().
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Optional

from . import io_errors
from .aio_config import ALIGN

Task = tuple[int, int, int, int, int]
"""(fd, fallback_fd, buffer address, length, file offset)."""

_O_DIRECT = getattr(os, "O_DIRECT", 0)

_refusals_lock = threading.Lock()
_direct_refusals: dict[int, str] = {}
"""st_dev of a file system -> why O_DIRECT is not used there (shown by engine_status)."""


def direct_refusals() -> dict[int, str]:
    with _refusals_lock:
        return dict(_direct_refusals)


@dataclass
class OpenFile:
    """The descriptors of one request; closed by ``close()`` once the request completed."""

    path: str
    buffered_fd: int
    direct_fd: Optional[int]

    def close(self) -> None:
        for fd in {self.buffered_fd, self.direct_fd}:
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.direct_fd = None
        self.buffered_fd = -1

    def size(self) -> Optional[int]:
        try:
            return os.fstat(self.buffered_fd).st_size
        except OSError:
            return None


def open_file(path: str, write: bool, use_direct: bool, offset: int, nbytes: int) -> OpenFile:
    """Opens (creating for writes) ``path``; raises ``AIOError`` naming the path on failure,
    and ``TruncatedFileError`` when a read would run past the end of the file."""
    flags = (os.O_WRONLY | os.O_CREAT) if write else os.O_RDONLY
    flags |= getattr(os, "O_CLOEXEC", 0)
    kind = "writing" if write else "reading"
    try:
        buffered = os.open(path, flags, 0o644)
    except OSError as exc:
        raise io_errors.open_error(exc, path, kind, offset, nbytes) from None
    try:
        st = os.fstat(buffered)
        if not write and nbytes and st.st_size < offset + nbytes:
            raise io_errors.past_eof(path, offset, nbytes, st.st_size)
        direct = _open_direct(path, flags, st.st_dev) if use_direct else None
    except BaseException:
        os.close(buffered)
        raise
    return OpenFile(path, buffered, direct)


def _open_direct(path: str, flags: int, dev: int) -> Optional[int]:
    if not _O_DIRECT:
        _record(dev, "this platform has no O_DIRECT")
        return None
    try:
        return os.open(path, flags | _O_DIRECT)
    except OSError as exc:
        # EINVAL is how Linux says "this file system does not do O_DIRECT" (tmpfs, ...).
        _record(dev, f"the file system of {path!r} refuses O_DIRECT ([errno {exc.errno}] {exc.strerror}); "
                     "buffered I/O is used there")
        return None


def _record(dev: int, why: str) -> None:
    with _refusals_lock:
        _direct_refusals.setdefault(dev, why)


def split(f: OpenFile, addr: int, nbytes: int, offset: int, block_size: int) -> list[Task]:
    """Block tasks covering ``nbytes`` at ``addr`` <-> file ``offset``; see Note [O_DIRECT and
    the unaligned tail]."""
    direct_ok = f.direct_fd is not None and addr % ALIGN == 0 and offset % ALIGN == 0
    direct_bytes = nbytes - nbytes % ALIGN if direct_ok else 0
    tasks: list[Task] = []
    for start, end, fd in ((0, direct_bytes, f.direct_fd), (direct_bytes, nbytes, f.buffered_fd)):
        pos = start
        while pos < end:
            n = min(block_size, end - pos)
            tasks.append((fd if fd is not None else f.buffered_fd, f.buffered_fd, addr + pos, n, offset + pos))
            pos += n
    return tasks
