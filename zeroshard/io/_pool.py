"""The pure-Python backend: the same block tasks, run by a pool of threads.

``os.preadv``/``os.pwritev`` release the GIL for the duration of the system call, so
``queue_depth`` Python threads keep as many requests in flight as the native engine does;
what costs more is the per-block Python overhead, which large blocks amortise.
"""
from __future__ import annotations

import ctypes
import errno
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from ._plan import Task

BACKEND = "python-threads"


class PyOp:
    """One request's tasks; the same surface as the native ``Op``."""

    def __init__(self, count: int) -> None:
        self._lock = threading.Lock()
        self._remaining = count
        self._done = threading.Event()
        self._error: tuple = (False, 0, -1, 0, 0, False)
        self._fallbacks = 0
        if count == 0:
            self._done.set()

    def fail(self, err: int, off: int, wanted: int, got: int, eof: bool) -> None:
        with self._lock:  # keep the failure nearest the file's start, as the native engine does
            if not self._error[0] or off < self._error[2]:
                self._error = (True, err, off, wanted, got, eof)

    @property
    def failed(self) -> bool:
        return self._error[0]

    def note_fallback(self) -> None:
        with self._lock:
            self._fallbacks += 1

    def finish_one(self) -> None:
        with self._lock:
            self._remaining -= 1
            if self._remaining == 0:
                self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        self._done.wait()

    def error(self) -> tuple:
        return self._error

    def direct_fallbacks(self) -> int:
        return self._fallbacks


def _run(op: PyOp, task: Task, write: bool) -> None:
    fd, fallback_fd, addr, length, off = task
    try:
        if op.failed:
            return  # another block of this request failed: skip the I/O
        view = memoryview((ctypes.c_char * length).from_address(addr)).cast("B")
        done = 0
        while done < length:
            part = view[done:]
            try:
                r = os.pwritev(fd, [part], off + done) if write else os.preadv(fd, [part], off + done)
            except InterruptedError:
                continue
            except OSError as exc:
                if exc.errno == errno.EINVAL and fd != fallback_fd:
                    fd = fallback_fd  # the file system refused O_DIRECT for this block
                    op.note_fallback()
                    continue
                op.fail(exc.errno or errno.EIO, off, length, done, False)
                return
            if r == 0:
                op.fail(errno.EIO if write else 0, off, length, done, not write)
                return
            done += r
    finally:
        op.finish_one()


class PyEngine:
    """Thread pool with the native ``Engine``'s surface: ``submit(tasks, write) -> op``."""

    def __init__(self, threads: int) -> None:
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="zeroshard-aio")
        self.threads = threads

    def submit(self, tasks: list[Task], write: bool) -> PyOp:
        op = PyOp(len(tasks))
        for t in tasks:
            self._pool.submit(_run, op, t, write)  # completion is tracked by op, not by futures
        return op

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)
