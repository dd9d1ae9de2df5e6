"""Preemption: SIGTERM / SIGUSR1 turn into "save at the next step boundary, then exit 0".

Spot instances and schedulers (Slurm's ``--signal``, Kubernetes, torchrun's own shutdown)
send SIGTERM or SIGUSR1 some seconds before they kill a job, often to one process only.
The handler only records the signal: a Python handler runs between bytecodes of the main
thread, so saving from inside it could interleave with a half-done step or collective.
At each step boundary the loop asks every rank (``agree``) and all ranks see the same answer,
because the flag travels in the same all-reduce (one tiny tensor) on every rank.
"""
from __future__ import annotations

import signal
import threading
import time
from types import FrameType
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

_Handler = Union[Callable[[int, Optional[FrameType]], Any], int, None]


class PreemptionHandler:
    """Records preemption signals; ``agree`` turns them into one decision for all ranks."""

    def __init__(self, signals: Sequence[signal.Signals] = DEFAULT_SIGNALS,
                 on_signal: Optional[Callable[[int], None]] = None, grace_s: Optional[float] = None) -> None:
        if grace_s is not None and (isinstance(grace_s, bool) or not isinstance(grace_s, (int, float)) or grace_s <= 0):
            raise ValueError(f"PreemptionHandler(grace_s={grace_s!r}) must be a number of seconds > 0 (how long "
                             "the scheduler waits between its signal and its kill), or None")
        self.signals = tuple(signals)
        self.grace_s = grace_s
        """Seconds between the signal and the scheduler's kill (None: not known); a handoff
        (``zeroshard.memory_handoff``) reports the time it took against it."""
        self.received: Optional[int] = None
        """The first preemption signal this process got, or None."""
        self.received_at: Optional[float] = None
        """``time.monotonic()`` when it came."""
        self._on_signal = on_signal
        self._previous: dict[int, _Handler] = {}

    def install(self) -> "PreemptionHandler":
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("signal handlers can only be installed from the main thread; build the "
                               "PreemptionHandler where the training loop runs")
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def __enter__(self) -> "PreemptionHandler":
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.uninstall()

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        # Only record: the step in progress finishes, the boundary decides (module docstring).
        if self.received is None:
            self.received, self.received_at = signum, time.monotonic()
            if self._on_signal is not None:
                self._on_signal(signum)

    @property
    def requested(self) -> bool:
        return self.received is not None

    def agree(self, group: Optional[dist.ProcessGroup] = None, values: Sequence[float] = ()) -> tuple[bool, list[float]]:
        """(any rank was signalled, ``values`` summed over ranks) with one all-reduce.

        The flag is summed too: a sum of 0/1 flags is positive exactly when their MAX is 1, and
        a SUM lets the step's loss share the same collective."""
        t = torch.tensor([1.0 if self.requested else 0.0, *values], dtype=torch.float64)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        return bool(t[0].item() > 0), t[1:].tolist()


def signal_name(signum: Optional[int]) -> str:
    if signum is None:
        return "none"
    try:
        return signal.Signals(signum).name
    except ValueError:
        return str(signum)
