"""Opening checkpoint files as untrusted input: regular files only, no symlinks, bounded reads.

Why each rule:
- *regular files only*: a FIFO named ``manifest.json`` blocks ``open()`` until a writer
  appears (a load that hangs forever), a character device (``/dev/zero``) never ends, a
  directory raises ``IsADirectoryError`` from deep inside a parser. ``lstat`` first, so
  nothing that is not a regular file is even opened; the open itself is ``O_NONBLOCK``
  (a FIFO swapped in after the ``lstat`` cannot block) and ``O_NOFOLLOW``, and ``fstat``
  of the open descriptor must be the same regular file the ``lstat`` saw.
- *no symlinks*: a checkpoint is a directory tree that someone else may have written; a
  link in it (a data file linked to ``/etc/passwd``, a step directory linked elsewhere)
  would make the loader read outside it. Links below the root are refused, never followed.
  The root (and the step directory a caller names explicitly) are the caller's own paths.
- *bounded reads*: every read is bounded by the file's real size and a limit per kind of
  file, so a manifest of a terabyte is refused before a byte is read.
"""
from __future__ import annotations

import json
import os
import stat
from typing import Any

from zeroshard.checkpoint.checkpoint_errors import CheckpointCorruptError

_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
_DIRECT = getattr(os, "O_DIRECT", 0)
MAX_JSON_DEPTH = 64
"""Nesting allowed in checkpoint JSON values: scheduler and sampler states nest a few levels."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def regular_size(path: str) -> int:
    """The size of ``path``, which must be a regular file and not a symlink (never opened)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{path} is missing; the checkpoint is incomplete") from None
    except OSError as exc:
        raise CheckpointCorruptError(f"{path} cannot be examined ({exc.strerror or exc})") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointCorruptError(f"{path} is {_kind(st.st_mode)}, not a regular file; checkpoint "
                                     "files are never followed or read through links, FIFOs or devices")
    return st.st_size


def is_real_dir(path: str) -> bool:
    """A directory that is not a symlink (a step directory linked elsewhere is not followed)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def open_regular(path: str, direct: bool = False) -> tuple[int, bool]:
    """A read-only descriptor of regular file ``path`` (see the module docstring); with
    ``direct``, O_DIRECT where the filesystem accepts it. Returns (fd, direct)."""
    regular_size(path)
    flags = _FLAGS
    if direct and _DIRECT and os.environ.get("ZEROSHARD_NO_DIRECT_IO", "0") != "1":
        try:
            fd = os.open(path, flags | _DIRECT)
            direct_ok = True
        except OSError:  # EINVAL on tmpfs and friends
            fd, direct_ok = _open(path, flags), False
    else:
        fd, direct_ok = _open(path, flags), False
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # replaced between the lstat and the open
        os.close(fd)
        raise CheckpointCorruptError(f"{path} is {_kind(st.st_mode)}, not a regular file")
    return fd, direct_ok


def _open(path: str, flags: int) -> int:
    try:
        return os.open(path, flags)
    except OSError as exc:  # ELOOP: a symlink swapped in after the lstat
        raise CheckpointCorruptError(f"{path} cannot be opened ({exc.strerror or exc})") from None


def read_small(path: str, limit: int) -> bytes:
    """The whole of a small regular file, at most ``limit`` bytes (more is refused unread)."""
    fd, _ = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise CheckpointCorruptError(f"{path} has {size} bytes, more than the {limit} a file of its "
                                         "kind may have; it is not a zeroshard checkpoint file")
        chunks, got = [], 0
        while got <= size:  # one byte more than the size: a file that grows is refused too
            data = os.read(fd, size + 1 - got)
            if not data:
                break
            chunks.append(data)
            got += len(data)
        if got != size:
            raise CheckpointCorruptError(f"{path} changed size while being read ({size} -> {got} bytes)")
        return b"".join(chunks)
    finally:
        os.close(fd)


def parse_json(raw: bytes, path: str) -> Any:
    """JSON from checkpoint bytes; every way it can be malformed is a CheckpointCorruptError."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise CheckpointCorruptError(f"{path}: JSON nested too deeply; not a zeroshard checkpoint file") from None
    except ValueError as exc:  # includes UnicodeDecodeError and int-digit limits
        raise CheckpointCorruptError(f"{path} is not valid JSON ({exc}); the file is damaged") from None
