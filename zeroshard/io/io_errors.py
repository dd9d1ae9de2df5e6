"""Errors of the I/O engine: an ``OSError`` that names the path, the offset and the errno."""
from __future__ import annotations

import errno as errno_mod
import os
import shutil
from typing import Optional


class AIOError(OSError):
    """A read or write that failed. ``errno``, ``filename`` (the path), ``offset`` (where the
    failing block starts in the file) and ``nbytes`` (size of the whole request) are set."""

    def __init__(self, err: int, message: str, path: str, offset: int, nbytes: int) -> None:
        super().__init__(err, message, path)
        self.offset = offset
        self.nbytes = nbytes

    def __str__(self) -> str:
        return str(self.strerror)


class DiskFullError(AIOError):
    """ENOSPC or EDQUOT: the file system holding ``filename`` has no room left."""


class TruncatedFileError(AIOError):
    """A read reached the end of the file before the requested bytes: never silent zeros."""


def _free_bytes(path: str) -> Optional[int]:
    try:
        return shutil.disk_usage(os.path.dirname(os.path.abspath(path)) or ".").free
    except OSError:
        return None


def past_eof(path: str, offset: int, nbytes: int, size: int) -> TruncatedFileError:
    return TruncatedFileError(
        errno_mod.EIO,
        f"read of bytes [{offset}, {offset + nbytes}) of {path!r} goes past its end: the file has {size} bytes "
        f"(truncated, or never fully written); refusing to return zeros",
        path, offset, nbytes)


def open_error(exc: OSError, path: str, kind: str, offset: int, nbytes: int) -> AIOError:
    """The file could not be opened or created (missing directory, read-only, permissions)."""
    hint = {
        errno_mod.ENOENT: "the file or its directory does not exist; create the directory first",
        errno_mod.EACCES: "permission denied; choose a directory this user can write",
        errno_mod.EROFS: "the file system is read-only; choose a writable directory",
        errno_mod.EISDIR: "the path is a directory; pass a file path inside it",
        errno_mod.ENOSPC: "no space left on the device",
    }.get(exc.errno or 0, os.strerror(exc.errno or 0) if exc.errno else str(exc))
    cls = DiskFullError if exc.errno in (errno_mod.ENOSPC, errno_mod.EDQUOT) else AIOError
    return cls(exc.errno or errno_mod.EIO,
               f"cannot open {path!r} for {kind} ({nbytes} bytes at offset {offset}): "
               f"[errno {exc.errno}] {hint}", path, offset, nbytes)


def io_error(path: str, write: bool, req_offset: int, nbytes: int, err: int, block_offset: int,
             wanted: int, got: int, eof: bool, file_size: Optional[int]) -> AIOError:
    """The error for a request whose block at ``block_offset`` failed after ``got`` of ``wanted`` bytes."""
    kind = "write" if write else "read"
    where = (f"{kind} of {nbytes} bytes at offset {req_offset} of {path!r} failed in the block at offset "
             f"{block_offset} (after {got} of {wanted} bytes)")
    if eof:
        return TruncatedFileError(
            errno_mod.EIO, f"{where}: unexpected end of file, the file has {file_size} bytes "
            f"(truncated while being read, or never fully written); refusing to return zeros",
            path, block_offset, nbytes)
    if err in (errno_mod.ENOSPC, errno_mod.EDQUOT):
        free = _free_bytes(path)
        return DiskFullError(
            err, f"disk full: {where}: [errno {err}] {os.strerror(err)}; the file system of {path!r} has "
            f"{free if free is not None else 'unknown'} bytes free. Free space there or point the "
            f"offload path at a larger disk", path, block_offset, nbytes)
    return AIOError(err, f"{where}: [errno {err}] {os.strerror(err)}", path, block_offset, nbytes)
