"""Gathering a unit by lending it its shard's memory, where the shard is the whole unit.

Note [gather by alias]: with one rank in the shard group (a single process, or hybrid sharding
whose shard group is one rank) the owned range of a unit is all of it, so its shard holds
exactly the values a gather would write into the gathered flat buffer. Copying them there
(what the gather did) costs a pass over the unit's bytes at every gather, twice a step: on the
12-block probe of ``benchmarks/bench_stage3_overhead.py`` that copy was about a tenth of stage
3's backward on the CPU. Instead the flat buffer's (empty) storage takes a *non-owning* view of
the shard's memory for as long as the unit is gathered (``lend``), and gives it back on release
(``take_back``); no byte moves, and the values are the same bits the copy made.

The flat buffer keeps its storage object (Note [released parameters] in gatherer.py): only the
memory under it changes, by ``UntypedStorage._swap_data_ptr_`` (the host pool's move), so every
view autograd saved sees the shard's values while the unit is gathered and 0 bytes after it is
released, exactly as before ("storage of size 0" still names a released parameter).

Where it applies (``can_lend``): the shard group has one rank and no hpZ secondary partition,
the shard stays in memory (not in a swap file) on the CPU beside the flat buffer, in the same
dtype, over the same bytes. Everything else gathers by copy as before (a CUDA device-to-device
copy is cheap beside the compute; host->device needs the copy anyway).

What differs from a copy: the shard is the gathered buffer, so a parameter changed in place
while its unit is gathered (torch code writing ``weight.data`` inside forward) changes the
shard too, as it would a plain model's; with a copy the change was dropped at release. The
optimizer step writes the shard only with the unit released (the overlapped step is awaited
by the gather: Note [overlapped step]), so training values are unchanged bit for bit.
"""
from __future__ import annotations

import ctypes

import torch

from zeroshard.units.flat_unit import FlatUnit

_AVAILABLE = hasattr(torch.UntypedStorage, "_swap_data_ptr_")


def can_lend(unit: FlatUnit, world_size: int) -> bool:
    """Whether ``unit``'s gather may be its shard's memory lent (Note [gather by alias])."""
    if not _AVAILABLE or world_size != 1 or unit.swap_holding("shard") is not None:
        return False
    shard, flat = unit.shard, unit.flat
    return (shard.device.type == "cpu" and flat.device == shard.device and shard.dtype == flat.dtype
            and shard.numel() == flat.numel() and shard.storage_offset() == 0 and flat.storage_offset() == 0
            and not shard.is_pinned() and shard.untyped_storage().nbytes() == flat.numel() * flat.element_size())


def lend(flat: torch.Tensor, shard: torch.Tensor) -> None:
    """``flat``'s empty storage takes a non-owning view of ``shard``'s memory."""
    dst = flat.untyped_storage()
    if dst.nbytes():
        raise RuntimeError(f"the gathered buffer holds {dst.nbytes()} bytes already; only an empty "
                           "(released) one can take its shard's memory")
    src = shard.untyped_storage()
    n = src.nbytes()
    if n != flat.numel() * flat.element_size():
        raise RuntimeError(f"the shard's storage has {n} bytes, the gathered buffer needs "
                           f"{flat.numel() * flat.element_size()}")
    # (a ctypes array over the shard's bytes owns nothing; the storage made from it only
    # holds a reference to that array, so dropping it frees nothing of the shard's)
    view = (ctypes.c_char * n).from_address(src.data_ptr())
    holder = torch.frombuffer(view, dtype=torch.uint8).untyped_storage()
    dst._swap_data_ptr_(holder)  # type: ignore[attr-defined]  # (private torch API; _AVAILABLE checked)


def take_back(flat: torch.Tensor) -> None:
    """``flat``'s storage lets go of the lent memory: 0 bytes again, the shard untouched."""
    empty = torch.UntypedStorage(0)
    flat.untyped_storage()._swap_data_ptr_(empty)  # type: ignore[attr-defined]  # (as in lend)
    del empty  # (holds the non-owning view now: dropping it releases only the ctypes array)
