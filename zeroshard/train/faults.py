"""Fault injection for tests and the demo: ``ZEROSHARD_FAULT=<kind>@<rank>:<step>``.

``kind`` is ``sigkill`` (the rank dies mid-step, after the forward of its first
micro-batch), ``sigterm``/``sigusr1`` (the rank sends itself that signal mid-step, as a
scheduler would), ``hang`` (the rank stops making progress, its threads still running: its own
``StepWatchdog`` ends it) or ``sigstop`` (the whole process is stopped, as by a debugger, a
frozen VM or ``kill -STOP``: nothing in it runs, so only the other ranks can act, Note [fencing
a stopped peer] in failures.py). It fires on the first
attempt only (``TORCHELASTIC_RESTART_COUNT`` 0 or unset), so a run restarted by
``torchrun --max-restarts`` proceeds. Unset, it costs one comparison per step.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Mapping, Optional

_KINDS = {"sigkill": signal.SIGKILL, "sigterm": signal.SIGTERM, "sigusr1": signal.SIGUSR1, "hang": None,
          "sigstop": signal.SIGSTOP}


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int

    def maybe_fire(self, rank: int, step: int) -> None:
        """Fires when this rank reaches the fault's step (1-based: the step being computed)."""
        if rank != self.rank or step != self.step:
            return
        sig = _KINDS[self.kind]
        if sig is None:  # "hang"
            while True:
                time.sleep(3600)
        os.kill(os.getpid(), sig)


def from_env(env: Optional[Mapping[str, str]] = None) -> Optional[Fault]:
    source: Mapping[str, str] = os.environ if env is None else env
    spec = source.get("ZEROSHARD_FAULT", "").strip()
    if not spec or source.get("TORCHELASTIC_RESTART_COUNT", "0") not in ("", "0"):
        return None
    try:
        kind, where = spec.split("@")
        rank, step = (int(x) for x in where.split(":"))
    except ValueError:
        raise ValueError(f"ZEROSHARD_FAULT={spec!r}: use <kind>@<rank>:<step>, e.g. sigkill@1:5") from None
    if kind not in _KINDS:
        raise ValueError(f"ZEROSHARD_FAULT kind {kind!r}: use one of {sorted(_KINDS)}")
    return Fault(kind, rank, step)
