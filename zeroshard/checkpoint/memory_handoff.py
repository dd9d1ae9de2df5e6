"""``memory_handoff``: preemption as a handoff to the peers' memory tiers. Called where an agreed
preemption save would be (after ``PreemptionHandler.agree`` said stop, on every rank).

Note [preemption handoff]:
A scheduler's SIGTERM (to one rank or a node's ranks, some seconds before its kill) is
recorded by ``PreemptionHandler``; at the next step boundary ``agree`` turns it into one
decision on every rank, at one step k. With ``redundancy="peer"`` the agreed action is a
handoff instead of a disk save: (1) step k is committed to the memory tier unless it already
is (forced past ``every``: the boundary agreed on is the step to keep) and the ranks wait for
the commit on every rank (own slot and the buddy's replica written and stamped); (2) the ranks
all-gather which of them were signalled (the leaving ranks: their node's memory is taken to
go with them); a leaving rank whose buddy leaves too (two adjacent ring members, e.g. two
ranks of one node on a one-node ring) sends its own slot of step k to the next staying rank
along the ring, which keeps it as ``rank-<s>/replica-<r>``, so every leaving rank's state is
held by a staying rank; (3) every rank returns and the caller exits 0. A restart at the
smaller world finds step k in the staying ranks' tiers and loads it without reading the disk
(``load_checkpoint``, Note [peer memory tier]). When every rank leaves there is no one to hand
to: each node's tier keeps its own ranks' state (a restart on the same nodes needs no disk);
the caller may still save to disk after the handoff (a disk step no newer than the tiers'
is not read). Under XOR parity only the leaving members of a group that loses
two or more are pushed (one per group is rebuilt from the parity: Note [parity memory tier] in
zeroshard/resilience/parity.py). A tier turned off (a full tmpfs) cannot take the handoff: it
returns ``handed_off=False`` and the caller saves to disk as before. The time from the signal to the
end of the handoff is reported against ``PreemptionHandler(grace_s=)`` with a warning when
over: the scheduler's kill is not something a process can postpone.
"""
from __future__ import annotations

import time
import warnings
from typing import TYPE_CHECKING, Optional

from torch import nn

from zeroshard.checkpoint.memory_commit import commit_step
from zeroshard.optim.zero_optimizer import engine_of

if TYPE_CHECKING:
    from zeroshard.train.preemption import PreemptionHandler


def memory_handoff(step: int, *, preemption: "PreemptionHandler", model: Optional[nn.Module], optimizer: object,
                   scheduler: object = None, dataloader: object = None, extra: object = None) -> dict:
    """Hands step ``step`` to the peers' memory tiers after an agreed preemption (a collective;
    Note [preemption handoff]). ``preemption``: the ``PreemptionHandler`` (this rank leaves when
    it was signalled). Returns {"step", "handed_off", "leaving", "pairs", "seconds",
    "since_signal", "grace_s"}; ``handed_off`` False (the tier is off) means: save to disk."""
    engine = engine_of(optimizer)
    tier = engine.memory_tier if engine is not None else None
    if tier is None:
        raise ValueError("memory_handoff needs the ZeroOptimizer built with redundancy='peer' "
                         "(or zeroshard.PeerRedundancy(...)); without it, save_checkpoint is the agreed action")
    began = time.monotonic()
    tier.wait()
    done = tier.committed == step and tier.ready(step, force=True)
    if not done and commit_step(step, force=True, model=model, optimizer=optimizer, scheduler=scheduler,
                                dataloader=dataloader, extra=extra):
        done = tier.ready(step, force=True)  # (waits, and agrees on any write failure)
    info: dict = {"step": step, "handed_off": done, "leaving": [], "pairs": [], "grace_s": preemption.grace_s}
    if done:
        info["leaving"], info["pairs"] = tier.hand_over(bool(preemption.requested))
    now = time.monotonic()
    info["seconds"] = now - began
    info["since_signal"] = now - preemption.received_at if preemption.received_at is not None else None
    if preemption.grace_s is not None and info["since_signal"] is not None and info["since_signal"] > preemption.grace_s:
        warnings.warn(f"the handoff of step {step} ended {info['since_signal']:.1f} s after the signal, past the "
                      f"grace budget of {preemption.grace_s} s: the scheduler may have killed a rank before it "
                      "finished (commit more often with PeerRedundancy(every=1) to shorten it)", stacklevel=2)
    return info
