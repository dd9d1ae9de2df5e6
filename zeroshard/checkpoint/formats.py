"""The public ``save_checkpoint`` / ``load_checkpoint``: zeroshard's own format, or a torch
Distributed Checkpoint (DCP).

``save_checkpoint(..., format="dcp")`` writes DCP (``dcp_write``). A directory holding a DCP
``.metadata`` (written by FSDP2, torchtitan or zeroshard) is read by ``dcp_read``, and so is a
root whose newest committed step is one; anything else by the native loader (``load``).
"""
from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING, Optional, cast

from torch import nn

from zeroshard.checkpoint import dcp_metadata, load, locate, manifest, safe_fs, saver
from zeroshard.checkpoint.saver import PendingSave, wait_checkpoint
from zeroshard.comm import Comm

if TYPE_CHECKING:
    from zeroshard.checkpoint.dcp_metadata import Stateful
    from zeroshard.optim.zero_optimizer import ZeroOptimizer


def load_checkpoint(path: str, *, model: Optional[nn.Module] = None, optimizer: "Optional[ZeroOptimizer]" = None,
                    scheduler: object = None, dataloader: object = None,
                    load_rng: bool = True) -> dict:
    """Loads the newest valid step under a root (or exactly the given step directory) into
    ``model``/``optimizer`` at any world size and stage (see ``zeroshard.checkpoint.load``).
    ``path`` may also be a torch Distributed Checkpoint directory (FSDP2, torchtitan): each
    rank reads only the chunks its pieces overlap (Note [DCP format mapping])."""
    if isinstance(path, (str, os.PathLike)):
        path = _newest_dcp_step(os.fspath(path)) or path
    if isinstance(path, (str, os.PathLike)) and dcp_metadata.is_dcp_dir(os.fspath(path)):
        wait_checkpoint()
        if model is None and optimizer is None:
            raise ValueError("load_checkpoint needs model=... and/or optimizer=...")
        comm = optimizer.engine.comm if optimizer is not None else Comm(None)
        from zeroshard.checkpoint import dcp_read  # (torch DCP imported only for a DCP checkpoint)
        return dcp_read.load_dcp(os.fspath(path), model, optimizer, cast("Optional[Stateful]", scheduler),
                                 cast("Optional[Stateful]", dataloader), comm, load_rng)
    return load.load_checkpoint(path, model=model, optimizer=optimizer, scheduler=scheduler, dataloader=dataloader,
                                load_rng=load_rng)


def _newest_dcp_step(root: str) -> Optional[str]:
    """``root``'s newest whole step directory if it is a DCP checkpoint (a root holding both
    formats resumes from its newest step; a damaged step is passed over for the one before)."""
    if dcp_metadata.is_dcp_dir(root) or locate.is_step_dir(root) or not os.path.isdir(root):
        return None
    steps = sorted((step, n) for n in os.listdir(root) for step in [manifest.step_of(n)] if step is not None)
    for _, name in reversed(steps):
        path = os.path.join(root, name)
        if dcp_metadata.is_dcp_dir(path):
            damage = dcp_metadata.verify(path)
            if damage is None:
                return path
            warnings.warn(f"skipping checkpoint {path}: {damage}", stacklevel=3)
        elif safe_fs.is_real_dir(path):
            return None  # (a native step: the native loader takes it from here; a link is never followed)
    return None


FORMATS = ("native", "dcp")


def save_checkpoint(root: str, step: int, *, model: Optional[nn.Module], optimizer: "Optional[ZeroOptimizer]",
                    scheduler: object = None, dataloader: object = None,
                    extra: object = None, async_save: bool = False, keep_last: Optional[int] = None,
                    save_frozen: Optional[bool] = None, format: str = "native") -> PendingSave:
    """Saves the full training state as ``root/step-NNNNNNNN`` (a collective; see
    ``zeroshard.checkpoint.saver``). ``format="dcp"`` writes a torch Distributed Checkpoint in
    torchtitan's layout that FSDP2 loads with ``dcp.load`` (Note [DCP format mapping]):
    a ZeroOptimizer's state; ``async_save`` and ``keep_last`` as for the native format (the
    retention counts native and DCP steps under ``root`` alike: Note [retention across formats])."""
    if format not in FORMATS:
        raise ValueError(f"format={format!r}: use 'native' (zeroshard's own, the default) or 'dcp' (torch "
                         "Distributed Checkpoint, for FSDP2/torchtitan)")
    if format == "native":
        return saver.save_checkpoint(root, step, model=model, optimizer=optimizer, scheduler=scheduler,
                                     dataloader=dataloader, extra=extra, async_save=async_save, keep_last=keep_last,
                                     save_frozen=save_frozen)
    if optimizer is None or not hasattr(optimizer, "engine"):
        raise TypeError(f"save_checkpoint(format='dcp') saves a ZeroOptimizer's state; got optimizer={optimizer!r}")
    if save_frozen is False:
        raise ValueError("save_checkpoint(format='dcp') writes frozen weights (got save_frozen=False): "
                         "leave it at its default, or save the native format")
    saver._check_arguments(root, step, keep_last, async_save)
    from zeroshard.checkpoint import dcp_write  # (torch DCP imported only for a DCP save)
    return dcp_write.save_dcp(os.fspath(root), step, model, optimizer, cast("Optional[Stateful]", scheduler),
                              cast("Optional[Stateful]", dataloader), extra, async_save, keep_last)
