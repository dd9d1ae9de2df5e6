"""Aligned (optionally pinned) host buffers, a byte view of a tensor, and a block checksum."""
from __future__ import annotations

import ctypes
import os
import weakref
import zlib
from typing import Optional

import torch

from .aio_config import ALIGN


def aligned_empty(numel: int, dtype: torch.dtype = torch.uint8, pin: Optional[bool] = None) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor whose data starts on a 4096-byte boundary (what O_DIRECT
    needs). ``pin=None`` pins when CUDA is available (fast host<->device copies); ``pin=True``
    without CUDA is an error."""
    if not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel={numel!r} must be a non-negative int")
    if pin is None:
        pin = torch.cuda.is_available()
    if pin and not torch.cuda.is_available():
        raise RuntimeError("aligned_empty(pin=True) needs CUDA (torch.cuda.is_available() is False); "
                           "pass pin=False or pin=None")
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = numel * itemsize
    # Over-allocate by one alignment unit and slice: allocators only promise 64-byte alignment.
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=bool(pin))
    skip = (-raw.data_ptr()) % ALIGN
    out = raw[skip:skip + nbytes].view(dtype)
    if not pin:
        advise_huge_pages(out)
    return out


_HUGE = 2 << 20
_MADV_HUGEPAGE = 14


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return "never"
    return text[text.index("[") + 1:text.index("]")] if "[" in text else "never"


_ADVISE = os.environ.get("ZEROSHARD_HUGE_PAGES", "1") != "0" and _thp_mode() == "madvise"
if _ADVISE:  # (Linux only: the mode file exists nowhere else)
    _libc = ctypes.CDLL(None, use_errno=True)
    _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def advise_huge_pages(t: torch.Tensor) -> None:
    """Asks the kernel for 2 MiB pages under ``t``'s bytes; call it before they are first
    touched. Note [huge pages for unit buffers]:

    Gathered parameters, gradient buckets and swapped parts are released after each use and
    re-allocated on the next (that is what keeps the process inside its budget), and glibc maps
    every such buffer afresh, so each use faults its pages in again: with 4 KiB pages, faulting
    and zeroing ran ~7x slower than the copy that fills them (30 vs 5 ms for 112 MB here), about
    a third of a CPU-offloaded stage-3 step. One fault per 2 MiB makes it ~6 ms. Only whole
    2 MiB pages inside the tensor are advised, so no page outside its bytes becomes resident.
    Where transparent huge pages are "always" this is what happens anyway; where "never", or
    with ZEROSHARD_HUGE_PAGES=0, nothing is done.
    """
    if not _ADVISE or t.device.type != "cpu" or t.is_pinned():
        return
    start = t.data_ptr()
    lo = -(-start // _HUGE) * _HUGE
    hi = (start + t.numel() * t.element_size()) // _HUGE * _HUGE
    if hi > lo:
        _libc.madvise(lo, hi - lo, _MADV_HUGEPAGE)  # (advice only: a refusal changes nothing)


MAPPED_BYTES = 32 << 20
"""glibc serves requests of at least this size (its largest mmap threshold) from their own
mapping, at the same offset into the first page every time: see Note [aligned swap parts]."""


def resizable_aligned(numel: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor on a 4096-byte boundary whose storage may be released
    and re-allocated (``free_storage`` / ``alloc_storage`` in zeroshard/units/flat_unit.py)
    and usually comes back on the boundary again. Note [aligned swap parts]:

    Swapped unit parts (stage-3 shards, masters, gradients and the gathered buffer a shard is
    read into) keep one storage object for their whole life and resize it to 0 bytes and back,
    so that every view of them stays valid. torch's allocator aligns to 64 bytes, and O_DIRECT
    needs 4096: an unaligned buffer goes through the page cache, which costs a memory copy in
    the kernel per byte moved (~2 core-seconds per GB here), charges the page cache to the
    memory cgroup and, for writes, runs at a third of the disk's speed. So the tensor is a view
    at a fixed offset into a storage of at least ``MAPPED_BYTES``: glibc maps such a request
    on its own, and the offset of the returned pointer into its first page (64 on x86-64
    glibc) is the same for every mapping, so the view is aligned after every re-allocation.
    Pages of the padding are never touched and cost no resident memory. Under another
    allocator the view may come back unaligned; the I/O engine then uses buffered I/O for it
    (correct, only slower), which ``SwapFile.direct_bytes`` shows.
    """
    if not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel={numel!r} must be a non-negative int")
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(padded_bytes(nbytes), dtype=torch.uint8)
    skip = (-raw.data_ptr()) % ALIGN  # a multiple of 64: of every element size too
    t = raw[skip:skip + nbytes].view(dtype)
    _PADDED[id(t)] = t
    advise_huge_pages(t)
    return t


_PADDED: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()
"""The tensors ``resizable_aligned`` made, by id (their storage is larger than they are)."""


def padded_bytes(nbytes: int) -> int:
    return max(MAPPED_BYTES, nbytes + ALIGN)


def storage_bytes(t: torch.Tensor) -> int:
    """The storage size that gives ``t`` (offset 0, or made by ``resizable_aligned``) its
    memory back."""
    if _PADDED.get(id(t)) is t:
        return padded_bytes(t.numel() * t.element_size())
    return (int(t.storage_offset()) + t.numel()) * t.element_size()


def held_bytes(t: torch.Tensor) -> int:
    """Bytes of memory ``t``'s storage holds: all of it, except for a ``resizable_aligned``
    tensor, whose padding is never touched (no resident pages): its own bytes."""
    n = t.untyped_storage().nbytes()
    if n and _PADDED.get(id(t)) is t:
        return t.numel() * t.element_size()
    return n


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous CPU tensor's bytes, for any dtype (bf16 too).
    The caller keeps ``tensor`` alive while the view is used."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def checksum(tensor: torch.Tensor, value: int = 0) -> int:
    """CRC-32 (zlib's, the one the checkpoint files use) of a contiguous CPU tensor's bytes.

    About 3.5 GB/s per core and the GIL is released, so it can run per block beside the
    I/O. ``value`` chains: ``checksum(b, checksum(a))`` equals the checksum of a then b."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"checksum needs a contiguous CPU tensor, got device={tensor.device}, "
                         f"contiguous={tensor.is_contiguous()}; pass tensor.contiguous().cpu()")
    return zlib.crc32(byte_view(tensor), value)
