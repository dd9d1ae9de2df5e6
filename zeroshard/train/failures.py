"""A rank that dies mid-step must not leave the others hanging: detect it, say so, exit.

Two layers:
- collectives carry a timeout (``init_process_group(timeout=--collective-timeout)``). On
  gloo a peer that dies closes its sockets, so the survivors' next collective fails at once
  ("Connection closed by peer"); a peer that hangs makes it fail after the timeout;
- ``StepWatchdog`` is the backstop for waits that are not collectives (a store, a stuck
  kernel): no step boundary for ``timeout`` seconds and the process exits non-zero itself.

A rank stopped whole (SIGSTOP) is the one hang its own watchdog cannot end; the survivors fence
it where they can (Note [fencing a stopped peer]).

Either way the surviving rank prints one message naming the step, the likely cause and how
to resume, then leaves with ``os._exit``: a normal exit would run process-group teardown,
which can block on the dead peer.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from typing import Callable, Iterator, Optional

EXIT_PEER_FAILURE = 3
"""Exit status of a rank that stopped because another rank died or hung."""

_PEER_MARKERS = ("connection closed", "connection reset", "timed out", "timeout", "broken pipe",
                 "gloo", "nccl", "socket", "peer", "connection refused")


def is_peer_failure(exc: BaseException) -> bool:
    """True for errors raised by a collective whose peer died or hung."""
    try:
        from torch.distributed import DistError
        if isinstance(exc, DistError):
            return True
    except ImportError:  # older torch without the DistError hierarchy
        pass
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(m in text for m in _PEER_MARKERS)


def peer_failure_message(rank: int, step: int, exc: BaseException, latest: Optional[str],
                         timeout_s: float) -> str:
    """``step``: the step being computed (1-based) when the collective failed."""
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    resume = (f"The latest checkpoint is {latest}: run the same command again to resume from it"
              if latest else "No checkpoint was saved yet: running the same command again starts over")
    return (f"zeroshard: rank {rank} stopped during step {step}: a collective failed ({first_line[:300]}). "
            f"The most likely cause is that another rank died (killed, out of memory, crashed) or hung "
            f"for more than --collective-timeout={timeout_s:g}s; check that rank's log. {resume}.")


# Note [fencing a stopped peer]: a stopped process (SIGSTOP, a frozen container) runs no
# thread, so its StepWatchdog never fires, and it does not act on SIGTERM until continued.
# torchrun's agent restarts a job by sending its workers SIGTERM and waiting 30 s before SIGKILL
# (measured: a 2-rank job whose rank 1 stopped itself restarted 41 s after the stop, 30 s of it
# that wait), and with --redundancy peer the restart's recovery from memory was ready long
# before. A survivor that stops on a peer failure therefore SIGKILLs its sibling processes (the
# launcher's other children: the ranks on its node) that are stopped — only those: a stopped
# process does no work that a kill could tear, and its state is in the memory tiers of the last
# commit (Note [peer memory tier]). A traced process ("t") is a debugger's and is left alone. A
# stopped rank alone on its node is not reachable this way; its agent's 30 s stands there. A
# sibling is fenced only when it is a rank of the same job (its environment names the same
# MASTER_ADDR, MASTER_PORT and TORCHELASTIC_RUN_ID, and a RANK): ranks started by hand from one
# shell share their parent with whatever else that shell runs, a job stopped with Ctrl-Z included.
_JOB_KEYS = ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def fence_stopped_peers() -> list[int]:
    """SIGKILLs this process's stopped siblings that are ranks of its job (see the Note above);
    returns their pids."""
    try:
        import psutil

        me = psutil.Process()
        parent = me.parent()
        siblings = parent.children() if parent is not None and parent.pid > 1 else []
    except Exception:  # noqa: BLE001 - fencing is best effort on a failure path
        return []
    job = tuple(os.environ.get(k) for k in _JOB_KEYS)
    if job[0] is None or job[1] is None:  # (not a rank of a launched job: nothing to tell its peers by)
        return []
    fenced = []
    for p in siblings:
        with contextlib.suppress(Exception):
            if p.pid != me.pid and p.status() == psutil.STATUS_STOPPED:
                env = p.environ()
                if "RANK" in env and tuple(env.get(k) for k in _JOB_KEYS) == job:
                    p.kill()
                    fenced.append(p.pid)
    return fenced


def fenced_note(fenced: list[int]) -> str:
    return (f" Killed stopped peer process(es) {', '.join(map(str, fenced))} on this node so the launcher can "
            f"restart the job at once (Note [fencing a stopped peer])." if fenced else "")


def exit_now(code: int, message: str, log: Optional[Callable[[str], None]] = None) -> None:
    """Prints ``message`` and ends the process at once (see the module docstring)."""
    if log is not None:
        with contextlib.suppress(Exception):
            log(message)
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        print(message, file=sys.stderr, flush=True)
    os._exit(code)


def end_process(code: int) -> None:
    """Ends a training process that has finished its work: flushes output and logs, then
    exits without interpreter teardown. See Note [teardown]."""
    with contextlib.suppress(Exception):
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


# Note [teardown]: after a run completes, every checkpoint is committed (fsynced, renamed)
# and the process group destroyed; nothing left to do can lose work. Interpreter teardown
# still runs native destructors (gloo/c10d objects, thread-pool workers) in whatever order
# the garbage collector picks, and once in CI a rank that had completed died there with
# "terminate called without an active exception" (SIGABRT). Under torchrun that turns a
# finished job into a failed one, or with --max-restarts into a pointless restart. So the
# training entry points end with os._exit once their work is flushed, as the failure paths
# (exit_now) already do.


class StepWatchdog:
    """Exits the process when no ``beat()`` came for ``timeout_s`` seconds (while armed)."""

    def __init__(self, timeout_s: float, rank: int, log: Optional[Callable[[str], None]] = None,
                 exit_code: int = EXIT_PEER_FAILURE) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s!r} must be > 0")
        self.timeout_s, self.rank, self.log, self.exit_code = timeout_s, rank, log, exit_code
        self.step = 0
        self._last = time.monotonic()
        self._paused = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="zeroshard-watchdog", daemon=True)

    def start(self) -> "StepWatchdog":
        self._last = time.monotonic()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def beat(self, step: int) -> None:
        self.step, self._last = step, time.monotonic()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No deadline inside (checkpoint save/load: their length scales with the model)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
            self._last = time.monotonic()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout_s / 4)):
            if self._paused or time.monotonic() - self._last < self.timeout_s:
                continue
            exit_now(self.exit_code, f"zeroshard: rank {self.rank} made no progress for {self.timeout_s:g}s "
                     f"after step {self.step}: another rank probably died or hung (check its log); "
                     "exiting so the job can be restarted from the latest checkpoint."
                     + fenced_note(fence_stopped_peers()), self.log)
