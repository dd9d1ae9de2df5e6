"""``load_checkpoint`` as users call it: given a checkpoint root, the memory tiers first, where the
optimizer keeps one and they hold a step at least as new as the disk's, else the disk
(``load.load_checkpoint``; a step directory given is loaded from the disk)."""
from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Optional, cast

from torch import nn

from zeroshard.checkpoint import formats, load, locate, parity_rebuild
from zeroshard.checkpoint.memory_recovery import recover
from zeroshard.checkpoint.names import committed_steps
from zeroshard.optim.zero_optimizer import engine_of

if TYPE_CHECKING:
    from zeroshard.optim.zero_optimizer import ZeroOptimizer


@functools.wraps(load.load_checkpoint)
def load_checkpoint(path: str, *, model: Optional[nn.Module] = None, optimizer: object = None,
                    scheduler: object = None, dataloader: object = None, load_rng: bool = True) -> dict:
    engine = engine_of(optimizer)
    tier = engine.memory_tier if engine is not None else None
    if tier is not None:  # (a commit in flight still reads the state this load replaces)
        tier.wait()
    # (a root: the memory tiers where they hold a step at least as new; a step directory names its step)
    if tier is not None and isinstance(path, (str, os.PathLike)) and not locate.is_step_dir(os.fspath(path)):
        path = os.fspath(path)
        steps = committed_steps(path)  # (Note [peer memory tier])
        info, why = recover(tier, model, cast("ZeroOptimizer", optimizer), scheduler, dataloader, load_rng, steps[-1][0] if steps else None)
        parity_rebuild.release(tier)  # (loaded or not: Note [parity memory tier])
        if info is not None:
            return info
        print(f"[zeroshard] rank {tier.rank}: loading from the disk checkpoint, not the memory tiers: {why}",
              flush=True)
    return formats.load_checkpoint(path, model=model, optimizer=optimizer,  # type: ignore[arg-type]
                                   scheduler=scheduler, dataloader=dataloader, load_rng=load_rng)
