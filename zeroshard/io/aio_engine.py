"""``AsyncIO``: asynchronous reads and writes of whole CPU tensors to files.

    io = AsyncIO(block_size=8 << 20, queue_depth=16)
    buf = aligned_empty(n, torch.float32)
    io.pwrite(buf, "/nvme/state.bin").wait()
    h = io.pread(buf, "/nvme/state.bin"); ...; h.wait()
    io.close()

Errors known before any I/O (the file cannot be opened or created; a read would run past
the end of the file) raise ``AIOError`` at submission; errors during the I/O raise from
``Handle.wait()`` (and ``wait_all()``). Both name the path, the offset and the errno.
"""
from __future__ import annotations

import os
import threading
import warnings
from typing import Any, Optional, Union

import torch

from . import _plan
from ._native import native
from ._pool import PyEngine
from .aio_config import AIOConfig
from .handle import Handle

PathLike = Union[str, "os.PathLike[str]"]

_warned = False  # the fallback is announced once per process


def _resolve_backend(requested: str) -> tuple[str, Any]:
    """(name, engine factory) for "auto" | "native" | "python"."""
    if requested == "python":
        return "python", PyEngine
    state = native()
    if requested == "kaio":
        if state.module is None or not hasattr(state.module, "AioEngine"):
            raise RuntimeError(f"backend='kaio' needs the native I/O engine, which is unavailable: {state.reason}")
        return "kaio", state.module.AioEngine
    if state.module is not None:
        return "native", state.module.Engine
    if requested == "native":
        raise RuntimeError(f"backend='native' requested but the native I/O engine is unavailable: {state.reason}. "
                           "Use backend='auto' to fall back to Python threads; `python -m zeroshard.io` explains")
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(f"zeroshard.io: native I/O engine unavailable ({state.reason}); using Python threads "
                      "(same files and errors). Run `python -m zeroshard.io` for details.", RuntimeWarning,
                      stacklevel=3)
    return "python", PyEngine


class AsyncIO:
    """An engine with ``queue_depth`` blocks of ``block_size`` bytes in flight."""

    def __init__(self, block_size: int = 8 << 20, queue_depth: int = 16, use_direct: bool = True,
                 backend: str = "auto") -> None:
        self.config = AIOConfig(block_size=block_size, queue_depth=queue_depth, use_direct=use_direct,
                                backend=backend)
        self.backend, factory = _resolve_backend(self.config.backend)
        self._engine = factory(self.config.queue_depth)
        self._lock = threading.Lock()
        self._pending: list[Handle] = []
        self._closed = False

    # -- requests ------------------------------------------------------------------------------
    def pwrite(self, tensor: torch.Tensor, path: PathLike, offset: int = 0) -> Handle:
        """Writes ``tensor``'s bytes to ``path`` at byte ``offset`` (the file is created if
        missing, never truncated). Do not modify ``tensor`` until the handle is waited."""
        return self._submit(tensor, path, offset, write=True)

    def pread(self, tensor: torch.Tensor, path: PathLike, offset: int = 0) -> Handle:
        """Fills ``tensor`` with the bytes of ``path`` at byte ``offset``; reading past the end
        of the file is an error, never zeros."""
        return self._submit(tensor, path, offset, write=False)

    def wait_all(self) -> None:
        """Waits for every request submitted so far; then raises the first error that no
        ``Handle.wait()`` has raised yet."""
        with self._lock:
            pending, self._pending = self._pending, []
        first: Optional[BaseException] = None
        for h in pending:
            if h.reap():
                continue
            try:
                h.wait()
            except OSError as exc:
                first = first or exc
        if first is not None:
            raise first

    def close(self) -> None:
        """Waits for everything in flight, then stops the workers. Idempotent."""
        if self._closed:
            return
        try:
            self.wait_all()
        finally:
            self._closed = True
            self._engine.shutdown()

    def __del__(self) -> None:
        # Dropped without close(): let the workers finish what is queued while this object's
        # pending handles still keep the tensors alive, and release the files; never raise here.
        if getattr(self, "_closed", True):
            return
        self._closed = True
        try:
            self._engine.shutdown()
            for h in self._pending:
                h.reap()
        except Exception:  # interpreter teardown: nothing useful left to do
            pass

    def __enter__(self) -> "AsyncIO":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        c = self.config
        return (f"AsyncIO(backend={self.backend!r}, block_size={c.block_size}, queue_depth={c.queue_depth}, "
                f"use_direct={c.use_direct})")

    # -- internals -----------------------------------------------------------------------------
    def _submit(self, tensor: torch.Tensor, path: PathLike, offset: int, write: bool) -> Handle:
        if self._closed:
            raise RuntimeError("this AsyncIO is closed; create a new one")
        path = os.fspath(path)
        _check_tensor(tensor, write)
        if not isinstance(offset, int) or offset < 0:
            raise ValueError(f"offset={offset!r} must be a non-negative int (bytes)")
        nbytes = tensor.numel() * tensor.element_size()
        f = _plan.open_file(path, write, self.config.use_direct, offset, nbytes)
        try:
            tasks = _plan.split(f, tensor.data_ptr(), nbytes, offset, self.config.block_size)
            op = self._engine.submit(tasks, write)
        except BaseException:
            f.close()
            raise
        direct_bytes = sum(t[3] for t in tasks if t[0] != t[1])
        h = Handle(op, f, tensor, path, offset, nbytes, write, direct_bytes)
        with self._lock:
            # Completed handles close their files and leave the list here, so a long-lived engine
            # holds neither descriptors nor tensors of finished requests; failed ones stay for wait_all.
            self._pending = [p for p in self._pending if not p.reap()]
            self._pending.append(h)
        h.on_success = self._forget
        return h

    def _forget(self, h: Handle) -> None:
        """A request waited on successfully leaves the list at once: its buffer (a gigabyte of
        moments, say) is then freed when its owner drops it, not at the next submit."""
        with self._lock:
            for i in range(len(self._pending) - 1, -1, -1):
                if self._pending[i] is h:
                    del self._pending[i]
                    break


def _check_tensor(tensor: torch.Tensor, write: bool) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"tensor is on {tensor.device}; the I/O engine reads and writes CPU memory: "
                         "copy it to a buffer from zeroshard.io.aligned_empty() first")
    if not tensor.is_contiguous():
        fix = "pass tensor.contiguous()" if write else "read into a contiguous buffer and copy it into the view"
        raise ValueError(f"tensor with shape={tuple(tensor.shape)} stride={tensor.stride()} is not contiguous; {fix}")
