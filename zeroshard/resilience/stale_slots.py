"""Slots of an earlier world left in a node's memory tier, removed once the current world's
first commit is complete on every rank.

Note [stale slots]:
A restart at another world size (a node lost, a preemption handed off, a rank added) recovers
from whatever the tiers hold: the old world's own slots, the replicas its buddies kept, the slots
a leaving rank pushed to a staying one. Once this world has committed a step on every rank, none
of them can be chosen again (a recovery takes the newest step every owner's pieces cover, and
the new step covers them all; a torn later commit falls back to the other slot of the new
layout), yet they used to stay in shared memory — RAM on most machines — until the run ended:
at world 4 -> 2, each survivor kept its old buddy's replica beside its new one, and the first
rank of the node kept the departed ranks' directories. So after the first commit that every
rank finished (the commit thread's gather over the group), each rank removes, under the node's
tier root, what the current layout does not use: in its own ``rank-<r>`` directory every entry
but ``own``, its current ``replica-<source>`` and ``parity``; and the first rank sharing the
root removes ``rank-<k>`` for every k >= the world size. Only slots stamped with this run's id
are removed (a slot of another run is refused at recovery and left to its owner), and an
unstamped slot (a write cut off) goes with its directory only when nothing else in it belongs to
another run. Nothing in use is touched: the own and current replica slots are the ones mapped.
"""
from __future__ import annotations

import os
import shutil

from zeroshard.resilience import slots


def _ours(directory: str, run_id: str) -> bool:
    """Whether every stamped slot under ``directory`` is this run's (an empty one is)."""
    for here, subdirs, _files in os.walk(directory):
        for sub in subdirs:
            stamp = slots.read_stamp(os.path.join(here, sub)) if sub in slots.SLOTS else None
            if stamp is not None and stamp.get("run_id") != run_id:
                return False
    return True


def prune(root: str, rank: int, world: int, keep: set[str], first_on_root: bool, run_id: str) -> list[str]:
    """Removes the directories of the Note above; returns what it removed (OSErrors are skipped:
    a tier that cannot shrink keeps working)."""
    doomed = []
    mine = os.path.join(root, f"rank-{rank}")
    try:
        doomed += [os.path.join(mine, e) for e in sorted(os.listdir(mine)) if e not in keep]
    except OSError:
        pass
    if first_on_root:
        try:
            entries = sorted(os.listdir(root))
        except OSError:
            entries = []
        for e in entries:
            k = e[len("rank-"):]
            if e.startswith("rank-") and k.isdigit() and int(k) >= world:
                doomed.append(os.path.join(root, e))
    removed = []
    for path in doomed:
        if os.path.islink(path) or not os.path.isdir(path) or not _ours(path, run_id):
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            removed.append(path)
    return removed
