"""Creating the per-rank swap files of NVMe offload: named, preallocated, cleaned up.

Swap files are scratch: each optimizer creates its own (named by kind, rank, pid and a
per-process serial) and state comes back from checkpoints, so a file truncated or damaged
between runs is never read. A file is allocated in full at creation (``posix_fallocate``),
so a disk that is too small fails then, with the size needed, and never in the middle of a
step with half the units updated.
"""
from __future__ import annotations

import errno
import glob
import itertools
import os
import re

from zeroshard.io import ALIGN, AIOError, DiskFullError

_created = itertools.count()


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to the O_DIRECT alignment (regions start aligned)."""
    return -(-nbytes // ALIGN) * ALIGN


def remove_stale_swap(nvme_path: str, kind: str, rank: int) -> None:
    """A file left by a killed run of this rank on this machine only takes space: remove it."""
    for path in glob.glob(os.path.join(nvme_path, f"zeroshard-{kind}-rank{rank:05d}-pid*.swap")):
        m = re.search(r"-pid(\d+)(-\d+)?\.swap$", path)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            try:
                os.unlink(path)
            except OSError:
                pass


def create_swap_file(nvme_path: str, kind: str, rank: int) -> str:
    """Creates this rank's empty ``kind`` swap file in ``nvme_path``; returns its path."""
    if not os.path.isdir(nvme_path):
        raise FileNotFoundError(f"nvme_path={nvme_path!r} is not a directory; create it or point "
                                "nvme_path at a directory on the NVMe drive")
    if not os.access(nvme_path, os.W_OK):
        raise PermissionError(f"nvme_path={nvme_path!r} is not writable by this process")
    remove_stale_swap(nvme_path, kind, rank)
    # Two optimizers of one process (a model and its resumed copy) must not share a file.
    path = os.path.join(nvme_path, f"zeroshard-{kind}-rank{rank:05d}-pid{os.getpid()}-{next(_created)}.swap")
    try:
        os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600))
    except OSError as exc:
        raise AIOError(exc.errno, f"cannot create the swap file {path!r}: {exc.strerror}; "
                       "nvme_path must be a writable directory", path, 0, 0) from exc
    return path


def reserve(path: str, offset: int, nbytes: int, what: str) -> None:
    """Allocates bytes ``[offset, offset + nbytes)`` of a swap file on disk now, so running
    out of space happens here. On failure the file is removed and ``what`` (formatted with
    ``gib``, the GiB asked for) starts the error message."""
    if nbytes <= 0:
        return
    fd = os.open(path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, offset, nbytes)
    except OSError as exc:
        os.unlink(path)
        cls = DiskFullError if exc.errno in (errno.ENOSPC, errno.EDQUOT) else AIOError
        raise cls(exc.errno, f"{what.format(gib=f'{(offset + nbytes) / 2**30:.3f}')} in "
                  f"{os.path.dirname(path)!r}, and the file system refused it ({exc.strerror}); free space "
                  "or use another nvme_path", path, offset, nbytes) from exc
    finally:
        os.close(fd)
