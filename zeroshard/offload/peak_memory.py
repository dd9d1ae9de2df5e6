"""The process's peak resident memory per training step, and what automatic placement does
when it exceeds the budget (Note [what the budget covers] in zeroshard/planner/auto_placement.py).

Lifecycle: ``StepPeaks(...)`` as the plan is made; ``on_backward`` / ``on_backward_end`` from
the gradient reducer's pass hooks, ``after_step()`` at the end of every optimizer step. The
peak of a step is VmHWM after a reset (``/proc/self/clear_refs``, Linux >= 4.0) at its first
backward, so neither start-up, weight loading nor a loaded and freed data set counts. With a
measured reserve the parameter cache starts empty, and step 1's backward peak (everything
the plan did not see: activations, autograd, lazy initialisation) sizes it. A step over the
budget is a warning with the figures. Without a way to reset the peak (another OS, no
/proc) nothing is measured and the planned cache is used as planned.

Note [freed memory goes back]: glibc keeps freed heap chunks (requests under its mmap
threshold, which grows up to 32 MiB as large blocks are freed) for reuse, so the resident
memory of a training process stays at the high-water mark of everything it ever freed: on a
6-block test model, 200 MiB over what it holds, and the peaks of later steps stack on it.
A memory budget is a promise about resident memory, so under offload="auto" what a phase
freed goes back at its end: ``trim_freed_memory`` (``malloc_trim``) runs at the end of every
backward pass and every optimizer step. Within a phase freed blocks are reused: backward
allocates a gradient per parameter and zeroshard frees it as soon as it is copied into the
unit, so the next parameter's gradient of the same size takes the same memory. The mmap
threshold is fixed above the model's largest parameter (``return_freed_memory``), or those
gradients would be mapped, page-faulted and zeroed afresh every time: with a 1 MiB threshold
(how this started) a 12-block model's backward faulted 1.35 GiB per pass, 0.1-0.7 GiB with it,
and the bigger-than-memory benchmark's backward took 5.2 s at the limit against 4.3 s for
explicit options, which never set it. What a phase holds at its peak is measured (step 1's
peak sizes the parameter cache), so the reuse stays within the budget. Both are process-wide
settings (mallopt, malloc_trim), made only when a budget is asked for.
"""
from __future__ import annotations

import ctypes
import dataclasses
import warnings
from typing import Any, Callable, Optional

from zeroshard.offload.process_rss import current_rss as resident_bytes, peak_rss as peak_bytes, reset_peak_rss as reset_peak  # noqa: F401 (re-exported: placement.py, tests)
from zeroshard.planner.auto_placement import Plan
from zeroshard.planner.sizes import fmt_bytes

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def _glibc() -> Optional[ctypes.CDLL]:
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # (only glibc has both the symbol and these parameters)
    except (OSError, AttributeError):
        return None
    return libc


def return_freed_memory(largest_block: int) -> bool:
    """Note [freed memory goes back]: blocks up to ``largest_block`` bytes (at least 1 MiB) come
    from the heap and are reused within a phase; False where the C library is not glibc."""
    libc = _glibc()
    if libc is None:
        return False
    # (a block of exactly the threshold is mapped: one MiB above the largest, rounded up)
    threshold = (largest_block // (1 << 20) + 1) * (1 << 20)
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2 * threshold))


def trim_freed_memory() -> None:
    """Gives the heap's free memory back to the system (Note [freed memory goes back])."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


class StepPeaks:
    def __init__(self, host_budget: int, calibrate: bool, fit_cache: Callable[[int], int], margin: int = 0) -> None:
        """``host_budget``: the bytes the process may hold. ``calibrate``: the reserve was
        measured, not given, so the parameter cache is sized from the first step's backward
        peak: ``fit_cache(room)`` keeps the planned cache units that fit in ``room`` bytes (all
        of them for a huge room, none for 0) and returns their bytes; ``margin``: bytes of the
        room left free (what the peak varies by from step to step)."""
        self.budget = host_budget
        self.margin = margin
        self.calibrate = calibrate
        self.fit_cache = fit_cache
        self.steps = 0
        self.backward_peak = 0
        self.step_peak: Optional[int] = None
        """The resident peak of the last step (its first backward to the end of the step)."""
        self.peak: Optional[int] = None
        """The largest step peak measured, over every step so far."""
        self.cache: Optional[int] = None
        """Bytes of parameter cache the calibration allowed (None: not calibrated)."""
        self._armed = False
        self.works = reset_peak()

    # -- hooks: the gradient reducer's pass start and end, the optimizer's step ------------------
    def on_backward(self) -> None:
        if self.works and not self._armed:
            reset_peak()
            self._armed = True

    def on_backward_end(self) -> None:
        if self._armed:
            self.backward_peak = max(self.backward_peak, peak_bytes())

    def after_step(self) -> None:
        if not self._armed:
            return
        self._armed = False
        self.steps += 1
        self.step_peak = max(self.backward_peak, peak_bytes())
        self.peak = max(self.peak or 0, self.step_peak)
        if self.steps == 1 and self.calibrate:
            # Cached shards live from forward into backward, beside what backward holds; the
            # step's own peak (the moments' pool) is after they are gone.
            # Less a margin: later steps read moments step 1 did not, and what waits on I/O at
            # the peak varies with the disk's timing by about a unit's parts.
            self.cache = self.fit_cache(max(0, self.budget - self.backward_peak - self.margin))
        over = self.step_peak - self.budget
        if over > 0 and self.steps <= 2:
            warnings.warn(
                f"offload='auto': step {self.steps} peaked at {fmt_bytes(self.step_peak)} of resident memory, "
                f"{fmt_bytes(over)} over the host budget of {fmt_bytes(self.budget)}; memory outside the plan "
                "(activations, data) is larger than the plan allowed: raise memory_budget, or pass "
                f"memory_budget={{..., 'reserve': ...}} with about {fmt_bytes(over)} more than it was",
                RuntimeWarning, stacklevel=3)
        self.backward_peak = 0

    def report(self) -> dict[str, Any]:
        return {"budget": self.budget, "measured": self.works, "steps": self.steps, "last_step_peak": self.step_peak,
                "peak": self.peak, "cache_allowed": self.cache}


def cache_within(plan: Plan, candidates: frozenset[int], room: int, note: Optional[str] = None) -> Plan:
    """``plan`` whose parameter cache is the ``candidates`` (latest units first: backward
    frees them first) that fit in ``room`` bytes; ``note`` replaces the reason it adds."""
    keep, used = set(), 0
    for i in sorted(candidates, reverse=True):
        if used + plan.units[i].shard <= room:
            keep.add(i)
            used += plan.units[i].shard
    note = note or (f"parameter cache sized by step 1's backward peak: {len(keep)} of {len(candidates)} planned "
                    f"unit(s) ({fmt_bytes(used)}) in the {fmt_bytes(room)} the budget left")
    return dataclasses.replace(plan, cached=frozenset(keep), reasons=plan.reasons + (note,))
