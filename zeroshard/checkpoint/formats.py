"""The public ``load_checkpoint``: zeroshard's own format, or a torch Distributed Checkpoint.

A directory holding a DCP ``.metadata`` (written by FSDP2, torchtitan or ``save_checkpoint(...,
format="dcp")``) is read by ``dcp_read``; anything else by the native loader (``load``).
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Optional

from torch import nn

from zeroshard.checkpoint import dcp_metadata, dcp_read, load
from zeroshard.checkpoint.saver import wait_checkpoint
from zeroshard.comm import Comm

if TYPE_CHECKING:
    from zeroshard.checkpoint.dcp_read import Stateful
    from zeroshard.optim.zero_optimizer import ZeroOptimizer


def load_checkpoint(path: str, *, model: Optional[nn.Module] = None, optimizer: "Optional[ZeroOptimizer]" = None,
                    scheduler: "Optional[Stateful]" = None, dataloader: "Optional[Stateful]" = None,
                    load_rng: bool = True) -> dict:
    """Loads the newest valid step under a root (or exactly the given step directory) into
    ``model``/``optimizer`` at any world size and stage (see ``zeroshard.checkpoint.load``).
    ``path`` may also be a torch Distributed Checkpoint directory (FSDP2, torchtitan): each
    rank reads only the chunks its pieces overlap (Note [DCP format mapping])."""
    if isinstance(path, (str, os.PathLike)) and dcp_metadata.is_dcp_dir(os.fspath(path)):
        wait_checkpoint()
        if model is None and optimizer is None:
            raise ValueError("load_checkpoint needs model=... and/or optimizer=...")
        comm = optimizer.engine.comm if optimizer is not None else Comm(None)
        return dcp_read.load_dcp(os.fspath(path), model, optimizer, scheduler, dataloader, comm)
    return load.load_checkpoint(path, model=model, optimizer=optimizer, scheduler=scheduler, dataloader=dataloader,
                                load_rng=load_rng)
