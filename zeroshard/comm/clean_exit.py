"""Process groups finished while Python is still alive, so a finished job exits 0.

Note [clean exit]: a gloo (or NCCL) worker thread completes a collective, marks its work done,
and only then drops its own reference to the work, which holds the collective's tensors. When
the caller's Python tensor died first (a temporary, or one of ``all_gather_object``'s), that
reference is the last one, and dropping it frees the tensor's preserved Python object: the
worker takes the GIL. If it asks for the GIL before finalization begins (torch leaks the
object, without the GIL, once it has begun) and gets it only after, ``take_gil`` ends the
worker with ``pthread_exit``, whose forced unwind runs through a noexcept destructor
(``~AsyncWork``): the process aborts with "terminate called without an active exception" (gdb:
``runLoop -> ~AsyncAllreduceWork -> decref_pyobject -> take_gil -> PyThread_exit_thread``), and
a rank whose work was all done fails its torchrun job. The main thread hands the GIL over
only every switch interval (5 ms) or when it blocks, so the window is the last moments before
finalization: hit when the worker was descheduled right after completing a collective (a
loaded machine; the last collective of an async save, whose thread is joined just before
finalization), or with a collective in flight that completes as the script ends.

The cure is torch's own advice, ``destroy_process_group()`` before exit, done for the user:
the first ``Comm`` over a process group registers ``finish_process_groups`` with ``atexit``.
atexit handlers run after non-daemon threads (an async save) are joined and before
finalization, while a worker may still take the GIL. Destroying the groups, and dropping the
references zeroshard's own objects hold, lets each ``ProcessGroupGloo`` destructor join its
workers, so none is left to drop a work later. Nothing is done when the user destroyed the
default group already, nor after an uncaught exception (destroying waits for collectives in
flight, and a rank that failed mid-step must not wait for peers that will never match; its
exit status is non-zero anyway). ``ZEROSHARD_KEEP_PROCESS_GROUP=1`` turns the hook off for
code that still runs collectives from its own atexit handlers.

A job that calls ``destroy_process_group()`` itself (torch's advice) needs the second half
too: torch forgets its groups, but a ``Comm`` of an optimizer still alive, or one in a
reference cycle not yet collected, keeps a ``ProcessGroupGloo`` (and its workers) alive until
finalization collects it -- the abort again (4 of 10 runs of a 2-rank stage-2 job before this
paragraph). So the hook also runs when the default group is gone: it drops those references,
collects, and waits for the workers to be idle, with no collective (issue 43;
benchmarks/check_exit_endings.py counts both endings under mp.spawn and torchrun).
"""
from __future__ import annotations

import atexit
import gc
import os
import sys
import threading
import time
import warnings
import weakref
from typing import Any

import torch.distributed as dist

_lock = threading.Lock()
_registered = False
_holders: "weakref.WeakSet[Any]" = weakref.WeakSet()
"""Objects with a ``group`` attribute (every ``Comm``) whose reference is dropped at exit."""

_WORKER_PREFIXES = ("pt_gloo", "pt_nccl")  # (torch names its collective worker threads so)


def watch(holder: Any) -> None:
    """Registers the exit hook once per process and remembers ``holder`` (its ``.group`` is
    set to None at exit, after the groups are destroyed, so nothing zeroshard owns keeps a
    destroyed group's worker threads alive)."""
    global _registered
    with _lock:
        _holders.add(holder)
        if not _registered:
            _registered = True
            atexit.register(finish_process_groups)


def finish_process_groups(timeout_s: float = 60.0) -> None:
    """Destroys every process group and waits until no collective worker thread can still
    drop a finished work (Note [clean exit]). Called by atexit; safe to call at any time
    after the last collective. A collective still in flight is waited for, at most
    ``timeout_s``: one whose peers never join it (ranks that diverged) must not hold the
    process for the backend's 30-minute timeout, which is what a plain exit would not do."""
    if os.environ.get("ZEROSHARD_KEEP_PROCESS_GROUP", "0") == "1":
        return
    if getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None:
        return  # an uncaught exception ended the script: see the Note
    if not (dist.is_available() and dist.is_initialized()):
        _release()  # the user destroyed the groups: what zeroshard still holds must go now (see the Note)
        return
    failed: list[BaseException] = []
    worker = threading.Thread(target=_finish, args=(failed,), name="zeroshard-exit", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        warnings.warn(f"zeroshard: a collective was still in flight at exit after {timeout_s:g} s (did the "
                      "ranks run different collectives?); exiting without it, which may abort the process",
                      RuntimeWarning)
    elif failed:
        exc = failed[0]
        warnings.warn(f"zeroshard: destroy_process_group() at exit failed ({type(exc).__name__}: {exc}); "
                      "call it yourself before the script ends", RuntimeWarning)


def _finish(failed: list) -> None:
    try:
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - reported by the caller; exit goes on
        failed.append(exc)
        return
    _release()


def _release() -> None:
    """Drops the references zeroshard's objects hold to process groups, so each group torch no
    longer holds is destroyed now, its worker threads joined while Python is alive."""
    for holder in list(_holders):
        holder.group = None
    gc.collect()  # (an optimizer in a reference cycle holds a Comm)
    _wait_idle(timeout_s=2.0)


def _worker_threads() -> list[str]:
    """/proc/self/task entries of this process's collective worker threads."""
    found = []
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().startswith(_WORKER_PREFIXES):
                    found.append(tid)
    except OSError:  # not Linux, or a thread ended meanwhile: nothing to wait for reliably
        return []
    return found


def _wait_idle(timeout_s: float) -> None:
    """For groups someone else still holds (so not destroyed): sleeps, with the GIL released,
    until every worker thread has been seen sleeping three times in a row. A worker that has
    yet to drop a finished work is running or runnable, or waits for the GIL, which sleeping
    hands it; one blocked in a collective in flight is asleep and cannot be helped."""
    deadline = time.monotonic() + timeout_s
    quiet = 0
    while quiet < 3 and time.monotonic() < deadline:
        tids = _worker_threads()
        if not tids:
            return
        time.sleep(0.002)
        quiet = quiet + 1 if all(_state(t) in ("S", "D", "?") for t in tids) else 0


def _state(tid: str) -> str:
    try:
        with open(f"/proc/self/task/{tid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"  # the thread ended
