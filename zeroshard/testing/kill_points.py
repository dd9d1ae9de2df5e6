"""Seeded SIGKILLs inside a step, for fault tests and benchmarks only:
``ZEROSHARD_TEST_KILL_AT=<point>:<step>:<rank>[:<nth>[:<attempt>]][,...]``.

Note [kill points]:
For the fault tests and benchmarks only (tests/dist/test_peer_recovery.py,
benchmarks/bench_peer_kill_points.py): a rank SIGKILLs itself at a named point inside a step,
where a real crash would land, so the memory tier's claim "the step in flight is lost, never
half-applied" (Note [peer memory tier]) is checked where it can break, not only between steps.
Read once at import: unset (every normal run), ``ARMED`` is None and each call site costs one
module-attribute None check. The points and where they are hit:

- ``forward``: the test's model calls ``hit`` from a forward hook (the forward is user code);
- ``reduce_scatter``: the backward's ``Reducer``, before each bucket's reduction starts (a
  reduce-scatter at stages 2 and 3, an all-reduce at stage 1);
- ``optimizer_step``: ``Stepper``, after each unit's update is written back (the masters
  moved, some model weights not yet: mid-way at ``nth`` < the number of units);
- ``replica_copy``: the memory tier's commit thread, after each tensor copied into the own
  slot, then once more after the own slot is stamped while the replica swap is in flight;
- ``save``: each named point of a disk save's protocol (zeroshard/checkpoint/commit.py);
- ``recovery``: a recovery from the memory tiers, once per rank after its piece exchange is
  posted (zeroshard/checkpoint/memory_recovery.py: the peers are sending to and receiving from
  it, no state applied yet); its ``step`` is the step being recovered.

``step`` is the 1-based step being computed (``steps_done + 1``) for forward, reduce_scatter
and optimizer_step, the step being committed or saved for replica_copy and save, and the step
being recovered for recovery. The
entry fires at its ``nth`` hit (default 1) of that point in that step on global rank ``rank``,
in torchrun attempt ``attempt`` (``TORCHELASTIC_RESTART_COUNT``, default 0), so a restarted
job runs on. ``ON_KILL``, when a benchmark sets it, runs just before the SIGKILL: it takes the
rest of the node down with the process (the launcher agent and the other workers, the node's
tier directory: a node lost, not a process) and notes the time of the kill.
"""
from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from typing import Callable, Optional

POINTS = ("forward", "reduce_scatter", "optimizer_step", "replica_copy", "save", "recovery")
ENV = "ZEROSHARD_TEST_KILL_AT"


@dataclass(frozen=True)
class KillAt:
    point: str
    step: int
    rank: int
    nth: int = 1
    attempt: int = 0


def parse(spec: str) -> tuple[KillAt, ...]:
    """The entries of ``spec``; ValueError naming the one that does not parse."""
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        fields = item.split(":")
        try:
            nums = [int(x) for x in fields[1:]]
        except ValueError:
            nums = []
        if fields[0] not in POINTS or not 2 <= len(nums) <= 4 or min(nums) < 0:
            raise ValueError(f"{ENV} entry {item!r}: use <point>:<step>:<rank>[:<nth>[:<attempt>]] with a point "
                             f"of {POINTS} and integers >= 0, e.g. optimizer_step:5:1:2")
        out.append(KillAt(fields[0], *nums))
    return tuple(out)


def _armed() -> Optional[tuple[KillAt, ...]]:
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    mine = tuple(k for k in parse(os.environ.get(ENV, "")) if k.attempt == attempt)
    return mine or None


ARMED: Optional[tuple[KillAt, ...]] = _armed()
"""This process's entries (its torchrun attempt's); None when unset: call sites check this first."""
steps_done = 0
"""Optimizer steps this process completed, counting the one in flight (set by ``Stepper.step``
and by a load's ``state_restored`` while armed)."""
_hits: dict[tuple[str, int], int] = {}
ON_KILL: Optional[Callable[[], None]] = None
"""Run just before the SIGKILL (a benchmark's: the node goes with the process, Note [kill points])."""


def hit(point: str, step: Optional[int] = None) -> None:
    """Counts a hit of ``point`` in ``step`` (None: ``steps_done + 1``) and SIGKILLs this process
    at an armed entry's ``nth`` hit (call only when ``ARMED`` is not None)."""
    armed = ARMED
    if armed is None:
        return
    step = steps_done + 1 if step is None else step
    key = (point, step)
    n = _hits[key] = _hits.get(key, 0) + 1
    rank = _rank()
    if any(k.point == point and k.step == step and k.nth == n and k.rank == rank for k in armed):
        if ON_KILL is not None:
            ON_KILL()
        os.kill(os.getpid(), signal.SIGKILL)


def _rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))
