"""``Teardown``: taking a ZeroOptimizer down again, from ``close()`` or once it is collected.

It holds nothing of the optimizer (a finalizer that referenced it would keep it alive): only
the removers of what it attached, weak references to its parameters, its step in flight and
the stage-3 hand-back (``ownership.hand_back_collected``).
"""
from __future__ import annotations

import threading
import warnings
import weakref
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch

from zeroshard.io.host_pool import HOST_POOL
from zeroshard.optim.ownership import _OWNER

if TYPE_CHECKING:
    from zeroshard.units.step_in_flight import StepInFlight


class Teardown:
    """Removes what a ZeroOptimizer attached to the model; idempotent. Runs from ``close()``
    or once the optimizer is collected (so it must not reference it): then it first waits for
    a step in flight and, at stage 3, gives the parameters back (``hand_back``), before the
    swap files close (they run it first: ``before_close``)."""

    def __init__(self, removers: Sequence[Callable[[], None]], params: Sequence[torch.Tensor],
                 inflight: Optional["StepInFlight"] = None, hand_back: Optional[Callable[[], None]] = None) -> None:
        self._removers = list(removers)
        self._params = [weakref.ref(p) for p in params]
        self._inflight = inflight
        self._hand_back = hand_back
        self.done = False

    def __call__(self, handed_back: bool = False) -> None:
        if self.done:
            return
        self.done = True
        # (at interpreter exit nothing will use the model again: no reading it back from disk)
        exiting = not threading.main_thread().is_alive()
        if self._inflight is not None:
            try:
                self._inflight.join()
            except BaseException as exc:  # (a finalizer has no caller to raise to)
                warnings.warn(f"the optimizer step in flight when the ZeroOptimizer was collected failed: "
                              f"{type(exc).__name__}: {exc}; its parameters are partly updated", stacklevel=2)
        if self._hand_back is not None and not handed_back and not exiting:
            try:
                self._hand_back()
            except Exception as exc:
                warnings.warn(f"giving the stage-3 parameters back as the ZeroOptimizer was collected failed "
                              f"({type(exc).__name__}: {exc}); call opt.close() before dropping it", stacklevel=2)
        for remove in self._removers:
            remove()
        for ref in self._params:
            p = ref()
            if p is not None and hasattr(p, _OWNER):
                delattr(p, _OWNER)
        HOST_POOL.trim(wait=False)  # (its buffers outlive steps, not the optimizer: Note [reused host buffers];
        # a finalizer may run inside the pool's own lock: Note [trim from a finalizer])
