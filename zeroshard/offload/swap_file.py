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


def create_swap_file(nvme_path: str, kind: str, rank: int, nbytes: int, what: str) -> str:
    """Creates and preallocates this rank's ``kind`` swap file of ``nbytes``; returns its path.
    ``what`` names the option and its content for the error message (e.g. "offload_optimizer='nvme'
    ... for this rank's optimizer state")."""
    if not os.path.isdir(nvme_path):
        raise FileNotFoundError(f"nvme_path={nvme_path!r} is not a directory; create it or point "
                                "nvme_path at a directory on the NVMe drive")
    if not os.access(nvme_path, os.W_OK):
        raise PermissionError(f"nvme_path={nvme_path!r} is not writable by this process")
    remove_stale_swap(nvme_path, kind, rank)
    # Two optimizers of one process (a model and its resumed copy) must not share a file.
    path = os.path.join(nvme_path, f"zeroshard-{kind}-rank{rank:05d}-pid{os.getpid()}-{next(_created)}.swap")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    except OSError as exc:
        raise AIOError(exc.errno, f"cannot create the swap file {path!r}: {exc.strerror}; "
                       "nvme_path must be a writable directory", path, 0, 0) from exc
    try:
        if nbytes:
            os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        os.unlink(path)
        cls = DiskFullError if exc.errno in (errno.ENOSPC, errno.EDQUOT) else AIOError
        raise cls(exc.errno, f"{what.format(gib=f'{nbytes / 2**30:.3f}', path=nvme_path)}, and the file "
                  f"system refused it ({exc.strerror}); free space or use another nvme_path", path, 0, nbytes) from exc
    finally:
        os.close(fd)
    return path
