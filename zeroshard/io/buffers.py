"""Aligned (optionally pinned) host buffers, a byte view of a tensor, and a block checksum."""
from __future__ import annotations

import ctypes
import zlib
from typing import Optional

import torch

from .config import ALIGN


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
    return raw[skip:skip + nbytes].view(dtype)


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
