"""A sharded state dict knows whether the other ranks saved theirs (issue 43).

Note [rank-only state dicts]: at stages 1-3 over several ranks (or with tp or pp),
``ZeroOptimizer.state_dict()`` holds this rank's shard only. nanoGPT's checkpoint code (and the
DDP idiom "rank 0 saves, every rank loads") writes it from rank 0 alone: the file held rank 0's
shard, the save succeeded silently, and the loss was found at resume (rank 1 refused to load
rank 0's pieces while rank 0 loaded its own and died in its next collective, "Connection
closed by peer"). So the dict carries a ``ShardMarker`` under ``REFUSED_KEY``. Pickled
(``torch.save``), the marker asks whether its peers are pickling theirs: each rank sets a key
in the c10d store for the optimizer's step and waits, at most ``ZEROSHARD_SAVE_AGREE_S``
seconds (default 10), for the keys of the other ranks of the shard group -- outside the process
group, so it never meets a collective. Every rank saving its own file (the legitimate per-rank
form) finds its peers and pickles a plain record ``{"rank", "world_size", "lone": False}``;
a rank saving alone warns at save time (``ShardOnlySaveWarning``: the fix, once per save) and
records ``"lone": True``, which ``load_state_dict`` refuses *on every rank*, from the file's
contents alone, with one error (the ranks that load the same file all refuse; none goes on to
wait in a collective). The warning is a category so a job can make it an error
(``warnings.simplefilter("error", zeroshard.ShardOnlySaveWarning)``).

What keeps working: in-memory copies (``copy.deepcopy``, Accelerate's ``prepare``), which keep
the live marker; ``consolidated_state_dict()`` (a plain torch.optim dict, no marker);
``zeroshard.save_checkpoint`` (never pickles); the Trainer/Accelerate/Lightning integrations,
whose ``SaveGuard`` (Note [rank-0 saves]) replaces the dict with the consolidated one on rank 0
and, unarmed, puts its own marker here that refuses at save naming the integration's fix. A
per-rank file whose ranks saved more than the bound apart is recorded lone; removing the
``REFUSED_KEY`` entry before ``load_state_dict`` loads it (the message says so).
"""
from __future__ import annotations

import datetime
import os
import warnings
from typing import TYPE_CHECKING, Optional, SupportsIndex

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from zeroshard.optim.zero_engine import EngineOwner

from zeroshard.stages.sharded_tensor import ShardOnlySaveWarning  # (pieces of stage-3 tensors warn alike)

REFUSED_KEY = "zeroshard_rank_shard_only"


def save_agree_seconds() -> float:
    return float(os.environ.get("ZEROSHARD_SAVE_AGREE_S", "10"))


def _saved_shard(rank: int, world_size: int, lone: bool) -> dict:
    """What a pickled marker loads as (plain data: torch.load(weights_only=True) builds it)."""
    return {"rank": int(rank), "world_size": int(world_size), "lone": bool(lone)}


torch.serialization.add_safe_globals([_saved_shard])


class ShardMarker:
    """In a rank's sharded state dict; see Note [rank-only state dicts]."""

    def __init__(self, ranks: list[int], rank: int, world_size: int, instance: int, step: int) -> None:
        self.ranks, self.rank, self.world_size = ranks, rank, world_size
        self.key = f"zeroshard/saved-shard/{instance}/{step}"

    def peers_save_too(self) -> bool:
        try:
            store = dist.distributed_c10d._get_default_store()
            store.set(f"{self.key}/{self.rank}", "1")
            peers = [f"{self.key}/{r}" for r in self.ranks if r != self.rank]
            store.wait(peers, datetime.timedelta(seconds=save_agree_seconds()))
            return True
        except (RuntimeError, ValueError, AttributeError):  # (torch's DistStoreError on timeout; no store)
            return False

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple:
        lone = not self.peers_save_too()
        if lone:
            warnings.warn(
                f"torch.save of ZeroOptimizer.state_dict() on rank {self.rank} while the other rank(s) of its "
                f"{self.world_size} did not save theirs within {save_agree_seconds():g} s: this state dict holds "
                "only this rank's shard, so the file cannot resume the optimizer (load_state_dict refuses it on "
                "every rank). Save the whole training state with zeroshard.save_checkpoint(...) on every rank, "
                "or opt.consolidated_state_dict() (a collective; rank 0 gets the whole state) and torch.save it "
                "on rank 0, or let every rank torch.save its own state_dict() to its own file "
                "(Note [rank-only state dicts])", ShardOnlySaveWarning, stacklevel=2)
        return (_saved_shard, (self.rank, self.world_size, lone))

    def __deepcopy__(self, memo: dict) -> "ShardMarker":
        return self

    def __repr__(self) -> str:
        return f"<zeroshard: rank {self.rank}'s shard of {self.world_size}; see Note [rank-only state dicts]>"


def marker_for(opt: "EngineOwner") -> Optional[ShardMarker]:
    """The marker of ``opt``'s sharded state dict, or None where it holds the whole state."""
    mesh = opt.engine.mesh
    comm = mesh.comm
    partial = (comm.world_size > 1 and opt.engine.config.stage >= 1) or mesh.tp is not None or mesh.pp is not None
    group = getattr(comm, "group", None)
    if not partial or group is None or not dist.is_initialized():
        return None
    instance = opt.engine.save_instance
    ranks = list(dist.get_process_group_ranks(group))
    return ShardMarker(ranks, dist.get_rank(), comm.world_size, instance, opt.engine.inflight.steps)


def refuse_lone(sd: dict) -> None:
    """Refuses a state dict that a rank saved alone (every rank refuses it alike)."""
    saved = sd.get(REFUSED_KEY)
    if isinstance(saved, dict) and saved.get("lone"):
        raise ValueError(
            f"this optimizer state dict was saved with torch.save by rank {saved.get('rank')} alone, while "
            f"{saved.get('world_size')} ranks held the state (the others did not save theirs at the same step): "
            "it holds only that rank's shard and cannot resume the optimizer on any rank. Resume from "
            "zeroshard.save_checkpoint(...)/load_checkpoint(...) or from opt.consolidated_state_dict() saved on "
            f"rank 0. If every rank did save its own file, remove sd[{REFUSED_KEY!r}] and load each rank's "
            "own file (Note [rank-only state dicts])")


def marked(opt: "EngineOwner", sd: dict) -> dict:
    """``sd`` (``opt``'s sharded state dict) with its marker where it holds only this rank's shard."""
    marker = marker_for(opt)
    if marker is not None:
        sd[REFUSED_KEY] = marker
    return sd
