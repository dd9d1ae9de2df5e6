"""``Handle``: one submitted read or write; ``wait()`` returns or raises ``AIOError``."""
from __future__ import annotations

import threading
from typing import Any, Optional

import torch

from . import io_errors
from ._plan import OpenFile


class Handle:
    """A request in flight. Keeps the tensor alive until the I/O is done; closes the file's
    descriptors on completion. ``wait()`` may be called any number of times, from any thread:
    it returns the tensor, or raises the same error each time."""

    def __init__(self, op: Any, f: Optional[OpenFile], tensor: torch.Tensor, path: str, offset: int,
                 nbytes: int, write: bool, direct_bytes: int = 0) -> None:
        self._op = op
        self._file = f
        self._tensor: Optional[torch.Tensor] = tensor
        self.path = path
        self.offset = offset
        self.nbytes = nbytes
        self.write = write
        self._lock = threading.Lock()
        self._finished = False
        self._error: Optional[io_errors.AIOError] = None
        self._reported = False  # the error reached a caller through wait()
        self.direct_bytes = direct_bytes
        """Bytes planned through O_DIRECT (the rest: unaligned tail or buffer, or no O_DIRECT)."""
        self.direct_fallbacks = 0
        """Blocks retried through the buffered descriptor because O_DIRECT was refused."""
        self.on_success: Optional[Any] = None
        """Called with this handle once a ``wait()`` returned successfully (the engine then lets
        go of it: a finished request must not keep its buffer alive until the next submit)."""

    def done(self) -> bool:
        """True once every block has completed (successfully or not); never blocks."""
        return self._finished or self._op is None or self._op.done()

    def wait(self) -> torch.Tensor:
        if self._op is not None:
            self._op.wait()  # releases the GIL in the native engine
        with self._lock:
            if not self._finished:
                self._finish()
            if self._error is not None:
                self._reported = True
                raise self._error
            assert self._tensor is not None
            done, self.on_success = self.on_success, None
        if done is not None:
            done(self)
        return self._tensor

    def reap(self) -> bool:
        """If the request has completed, closes its descriptors (records any error for
        ``wait``) and returns True when nothing is left to report: it succeeded, or its
        error was already raised by ``wait()``. Never blocks."""
        if not self.done():
            return False
        with self._lock:
            if not self._finished:
                self._finish()
            return self._error is None or self._reported

    def _finish(self) -> None:
        self._finished = True
        if self._op is not None:
            failed, err, off, wanted, got, eof = self._op.error()
            self.direct_fallbacks = int(self._op.direct_fallbacks())
            if failed:
                size = self._file.size() if self._file is not None else None
                self._error = io_errors.io_error(self.path, self.write, self.offset, self.nbytes, err, off,
                                              wanted, got, eof, size)
        if self._file is not None:
            self._file.close()
        self._op = None

    def __repr__(self) -> str:
        kind = "pwrite" if self.write else "pread"
        return f"Handle({kind} {self.path!r} offset={self.offset} nbytes={self.nbytes} done={self.done()})"
