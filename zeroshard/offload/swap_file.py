"""The per-rank swap files of NVMe offload: created, preallocated, guarded, cleaned up.

Swap files are scratch: each optimizer creates its own (named by kind, rank, pid and a
per-process serial) and state comes back from checkpoints, so a file left by an earlier
run is never read. A file is allocated in full as the optimizer is built
(``posix_fallocate``), so a disk that is too small fails then, with the size needed, and
never in the middle of a step with half the units updated.

Note [guarded swap files]: the file is state that exists nowhere else, so damage must stop
training rather than turn into zeros. ``SwapFile`` keeps a descriptor open for the file's
life and
- the engine reaches the file through that descriptor (``/proc/self/fd/N``), so no write
  ever creates a file again (the engine opens with O_CREAT; by name, a deleted swap file
  would come back sparse and its unwritten regions read as zeros);
- before every request and after every completed one, the path must still name the same
  file (``stat`` vs ``fstat``) and the file must keep its size and its preallocated blocks:
  deleting, replacing, truncating or hole-punching the file is an error naming it;
- reads are spot-checked against the first word of every page written
  (Note [zero-fill detection] in ``page_samples.py``).

Note [stale swap files]: a killed run leaves its files behind. At start-up every
``zeroshard-*.swap`` in ``nvme_path`` (any kind, rank or world size) is removed when no
process holds its lock (each live file is ``flock``-ed by its creator, and the kernel drops
the lock of a killed process) and the pid in its name is not a live process here (a file
of an older zeroshard, without the lock, or one being created). A file whose lock is held
(a live run, even in another pid namespace) is never touched.
"""
from __future__ import annotations

import errno
import fcntl
import glob
import itertools
import os
import re
import stat
import threading
from typing import Any, Optional

import torch

from zeroshard.io import ALIGN, AIOError, AsyncIO, DiskFullError, TruncatedFileError
from zeroshard.offload.page_samples import PageSamples

_created = itertools.count()
_NAME = re.compile(r"^zeroshard-[a-z]+-rank\d+-pid(\d+)(-\d+)?\.swap$")


class SwapFileDamagedError(AIOError):
    """A swap file was deleted, replaced or overwritten while training used it."""


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to the O_DIRECT alignment (regions start aligned)."""
    return -(-nbytes // ALIGN) * ALIGN


def _pid_alive(pid: int) -> bool:
    return pid == os.getpid() or os.path.exists(f"/proc/{pid}")


def _lock_is_free(path: str) -> bool:
    """True when no process holds ``path``'s lock; False for a held lock or a non-regular file."""
    try:  # O_NONBLOCK: a FIFO under a swap name must not hang start-up; O_NOFOLLOW: no links
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        return True  # (closing the descriptor releases the lock just taken)
    finally:
        os.close(fd)


def remove_stale_swap(nvme_path: str) -> list[str]:
    """Removes swap files of dead runs from ``nvme_path`` (Note [stale swap files]); returns them."""
    removed = []
    for path in glob.glob(os.path.join(glob.escape(nvme_path), "zeroshard-*.swap")):
        m = _NAME.match(os.path.basename(path))
        if m is None:
            continue
        pid = int(m.group(1))
        if pid != os.getpid() and _pid_alive(pid):
            continue
        if not _lock_is_free(path):
            continue
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:  # another rank removed it first, or the directory is read-only
            pass
    return removed


class _Checked:
    """A request of a ``SwapFile``: ``wait()`` completes it, then checks the file (and a
    read's page samples); errors name the swap file."""

    def __init__(self, swap: "SwapFile", handle: Any, tensor: torch.Tensor, offset: int, write: bool) -> None:
        self.swap, self.handle, self.tensor, self.offset, self.write = swap, handle, tensor, offset, write
        self._done = False

    def wait(self) -> torch.Tensor:
        if not self._done:
            try:
                self.handle.wait()
            except OSError as exc:
                raise self.swap.renamed(exc) from None
            self.swap.check()
            if not self.write:
                self.swap.verify(self.offset, self.tensor)
            self._done = True
        return self.tensor


class SwapFile:
    """One swap file: a held, locked descriptor, its preallocated size, and the engine."""

    def __init__(self, nvme_path: str, kind: str, rank: int) -> None:
        if not os.path.isdir(nvme_path):
            raise FileNotFoundError(f"nvme_path={nvme_path!r} is not a directory; create it or point "
                                    "nvme_path at a directory on the NVMe drive")
        if not os.access(nvme_path, os.W_OK):
            raise PermissionError(f"nvme_path={nvme_path!r} is not writable by this process")
        remove_stale_swap(nvme_path)
        self.fd, self.path = self._create(nvme_path, kind, rank)
        st = os.fstat(self.fd)
        self._identity = (st.st_dev, st.st_ino)
        self.size = 0
        """Bytes preallocated so far: the file may never be shorter."""
        self._blocks = 0
        """``st_blocks`` once preallocated, when the file system counts preallocation (else 0)."""
        proc = f"/proc/self/fd/{self.fd}"
        self.engine_path = proc if os.path.exists(proc) else self.path
        self.aio = AsyncIO()
        self._urgent: Optional[AsyncIO] = None
        self._count_lock = threading.Lock()  # (a step in flight counts from its own thread)
        self.samples = PageSamples()
        self.bytes_read = 0
        self.bytes_written = 0
        self.direct_bytes = 0
        """Of those, the bytes that went through O_DIRECT (the rest through the page cache:
        an unaligned buffer, Note [aligned swap parts] in zeroshard/io/buffers.py)."""
        """Bytes requested of the file so far (what ``placement_report`` measures)."""
        self.closed = False

    @staticmethod
    def _create(nvme_path: str, kind: str, rank: int) -> tuple[int, str]:
        # Created under a name the cleanup ignores, locked, then renamed: a file carrying a
        # swap name is locked for as long as its run lives (Note [stale swap files]).
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        while True:  # a reused pid can meet the name of a dead run's file: take the next serial
            path = os.path.join(nvme_path, f"zeroshard-{kind}-rank{rank:05d}-pid{os.getpid()}-{next(_created)}.swap")
            if os.path.lexists(path):
                continue
            tmp = f"{path}.new"
            try:
                fd = os.open(tmp, flags, 0o600)
            except FileExistsError:
                continue
            except OSError as exc:
                raise AIOError(exc.errno or errno.EIO, f"cannot create the swap file {path!r}: {exc.strerror}; "
                               "nvme_path must be a writable directory", path, 0, 0) from exc
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.rename(tmp, path)
            except OSError as exc:
                os.close(fd)
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise AIOError(exc.errno or errno.EIO, f"cannot create the swap file {path!r}: {exc.strerror}",
                               path, 0, 0) from exc
            return fd, path

    # -- space ------------------------------------------------------------------------------
    def reserve(self, offset: int, nbytes: int, what: str) -> None:
        """Allocates bytes ``[offset, offset + nbytes)`` on disk now, so running out of space
        happens here. On failure the file is removed and ``what`` (formatted with ``gib``,
        the GiB asked for) starts the error message."""
        if nbytes <= 0:
            return
        try:
            os.posix_fallocate(self.fd, offset, nbytes)
        except OSError as exc:
            self.close()
            cls = DiskFullError if exc.errno in (errno.ENOSPC, errno.EDQUOT) else AIOError
            raise cls(exc.errno or errno.EIO, f"{what.format(gib=f'{(offset + nbytes) / 2**30:.3f}')} in "
                      f"{os.path.dirname(self.path)!r}, and the file system refused it ({exc.strerror}); free "
                      "space or use another nvme_path", self.path, offset, nbytes) from exc
        self.size = max(self.size, offset + nbytes)
        blocks = os.fstat(self.fd).st_blocks
        # Only a file system that reports the preallocation in st_blocks (ext4, xfs, tmpfs)
        # gets the hole check: elsewhere (compressing or copy-on-write ones) counts may move.
        self._blocks = blocks if blocks * 512 >= self.size else 0

    # -- guards ---------------------------------------------------------------------------------
    def _damaged(self, what: str, cls: type = SwapFileDamagedError) -> AIOError:
        return cls(errno.EIO, f"the swap file {self.path!r} {what}; the training state it held is lost. "
                   "Restart from the last checkpoint, and keep other programs away from nvme_path",
                   self.path, 0, self.size)

    def check(self) -> None:
        """Raises unless the path still names this file, unshortened (Note [guarded swap files])."""
        st = os.fstat(self.fd)
        try:
            named = os.stat(self.path)
        except FileNotFoundError:
            raise self._damaged("was deleted while training used it") from None
        if st.st_nlink == 0 or (named.st_dev, named.st_ino) != self._identity:
            raise self._damaged("was replaced by another file while training used it")
        if st.st_size < self.size:
            raise self._damaged(f"was truncated to {st.st_size} bytes while training used it (it had "
                                f"{self.size})", TruncatedFileError)
        # (A few blocks may come and go with the extent tree; truncating and writing again, or
        # punching holes, loses whole regions.)
        if self._blocks and (self._blocks - st.st_blocks) * 512 > max(256 << 10, self.size >> 10):
            raise self._damaged(f"lost {(self._blocks - st.st_blocks) * 512} bytes of its preallocated blocks "
                                "(truncated and rewritten, or holes punched) while training used it")

    def verify(self, offset: int, data: torch.Tensor) -> None:
        bad = self.samples.verify(offset, data)
        if bad is not None:
            raise self._damaged(f"reads back different bytes at offset {bad} than were written there "
                                "(zero-filled or overwritten while training used it)")

    def renamed(self, exc: OSError) -> OSError:
        """``exc`` of the engine, naming the swap file instead of the descriptor it went through."""
        self.check()  # a damaged file explains itself best
        if self.engine_path == self.path or not isinstance(exc, AIOError):
            return exc
        msg = str(exc).replace(repr(self.engine_path), repr(self.path)).replace(self.engine_path, self.path)
        err = exc.errno if exc.errno is not None else errno.EIO  # (an AIOError always has one)
        return type(exc)(err, msg, self.path, exc.offset, exc.nbytes)

    # -- requests -----------------------------------------------------------------------------
    def pread(self, tensor: torch.Tensor, offset: int, urgent: bool = False) -> _Checked:
        """``urgent``: through a second engine of its own, so the read does not queue behind
        the requests already in flight (a gather that forward waits on, behind a step in
        flight: Note [overlapped step] in zeroshard/units/step_in_flight.py)."""
        self.check()
        engine = self.aio
        if urgent:
            if self._urgent is None:
                self._urgent = AsyncIO(queue_depth=8)
            engine = self._urgent
        try:
            h = engine.pread(tensor, self.engine_path, offset)
        except OSError as exc:
            raise self.renamed(exc) from None
        with self._count_lock:
            self.bytes_read += tensor.numel() * tensor.element_size()
            self.direct_bytes += h.direct_bytes
        return _Checked(self, h, tensor, offset, write=False)

    def pwrite(self, tensor: torch.Tensor, offset: int) -> _Checked:
        nbytes = tensor.numel() * tensor.element_size()
        if offset + nbytes > self.size:  # the engine would extend the file: never past the reservation
            raise ValueError(f"write of {nbytes} bytes at offset {offset} runs past the {self.size} bytes "
                             f"reserved in {self.path!r}")
        self.check()
        self.samples.record(offset, tensor)
        try:
            h = self.aio.pwrite(tensor, self.engine_path, offset)
        except OSError as exc:
            raise self.renamed(exc) from None
        with self._count_lock:
            self.bytes_written += nbytes
            self.direct_bytes += h.direct_bytes
        return _Checked(self, h, tensor, offset, write=True)

    def close(self) -> None:
        """Stops the engine, removes the file (if the path still names it) and drops the lock."""
        if self.closed:
            return
        self.closed = True
        try:
            if hasattr(self, "aio"):
                self.aio.close()
            urgent = getattr(self, "_urgent", None)  # (a half-built file may lack it)
            if urgent is not None:
                urgent.close()
        except OSError:  # a failed request of a file being discarded loses nothing
            pass
        finally:
            try:
                named = os.stat(self.path)
                if (named.st_dev, named.st_ino) == self._identity:  # never remove another file
                    os.unlink(self.path)
            except (OSError, AttributeError):
                pass
            os.close(self.fd)
