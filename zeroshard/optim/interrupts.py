"""A step cut short: Ctrl-C held until the step ends, and a failed step's refusal lifted once the
optimizer's state is restored (Note [failed steps] in units/step_in_flight.py)."""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator, Optional

from zeroshard.testing import kill_points


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Ctrl-C (SIGINT) inside the block takes effect as it ends, so an update is applied to every
    unit or to none (Note [saving between steps] in stages/stage3/gatherer.py); a second Ctrl-C
    goes through at once (a hung collective can still be interrupted). Only where Python
    handles SIGINT: the main thread, with a Python-level handler."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):  # SIG_IGN, SIG_DFL, or a handler set outside Python
        yield
        return
    held: list[Any] = []

    def hold(signum: int, frame: Any) -> None:
        held.append(frame)
        if len(held) > 1:
            signal.signal(signal.SIGINT, previous)
            previous(signum, frame)
    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGINT) is hold:
            signal.signal(signal.SIGINT, previous)
        if len(held) == 1:
            previous(signal.SIGINT, held[0])


def state_restored(opt: object, step: Optional[int] = None) -> None:
    """The optimizer's whole state was loaded (a checkpoint, a state dict): a failed step's
    refusal ends (Note [failed steps]), and a checkpoint's step becomes ``steps_done``. (Any
    torch.optim optimizer loads a checkpoint; only a ZeroOptimizer's engine counts steps.)"""
    engine = getattr(opt, "engine", None)
    if engine is not None:
        engine.inflight.restored()
        if step is not None:
            engine.inflight.steps = int(step)
            if kill_points.ARMED is not None:  # (fault tests only: Note [kill points])
                kill_points.steps_done = int(step)
