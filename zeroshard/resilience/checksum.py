"""The checksum of a memory tier slot's data: CRC-32C computed while the state is copied into
the slot (csrc/checksum/crc32c.cpp), or zlib's crc32 where that kernel is not built.

Note [slot checksum]:
A commit used to copy the state into its slot and then read the slot again for zlib's crc32:
two passes over the state, the crc32 the slower one (57 ms per 100 MB against 21 ms for the
copy on this project's 2-core VM; profile in docs/results.md). The native kernel copies each
tensor and computes CRC-32C over the bytes as they pass (the SSE4.2 instruction, ~8 GB/s), so
the checksum costs almost nothing over the copy. The slot's stamp names the algorithm
(``checksum``: "crc32c", or "crc32" — also what a stamp without the field means), and a read
verifies with the algorithm its stamp names: a slot is never accepted unchecked (a CRC-32C
slot where the kernel cannot be loaded is refused, as a torn one is: the other slot or the disk
serves). The checksum covers the whole data file, the alignment gaps between tensors included,
exactly as the crc32 did, so what a torn-slot check catches is unchanged (any CRC catches every
burst shorter than 32 bits and a fraction 2^-32 of the rest). Parity groups use the same
algorithm: a parity slot is stamped with it, and the rebuild (zeroshard/checkpoint/parity_rebuild.py)
checks a rebuilt member with the algorithm that member's stamp names.
"""
from __future__ import annotations

import threading
import zlib
from types import ModuleType
from typing import Callable, Optional

import torch

CRC32, CRC32C = "crc32", "crc32c"
_lock = threading.Lock()
_module: Optional[ModuleType] = None
_looked = False
reason = ""
"""Why the kernel is not available ("" while it is, or before it was looked for)."""


def native() -> Optional[ModuleType]:
    """The CRC-32C kernel, looked for (and built) at most once per process; None without it."""
    global _module, _looked, reason
    with _lock:
        if not _looked:
            from zeroshard.ops._build_spec import CHECKSUM
            from zeroshard.ops._loader import _find

            state = _find(CHECKSUM)
            _module, _looked, reason = state.module, True, ("" if state.module is not None else state.reason)
        return _module


def preferred() -> str:
    """The algorithm a new slot is stamped with: CRC-32C where the kernel loads, else crc32."""
    return CRC32C if native() is not None else CRC32


def _flat(buf: torch.Tensor) -> torch.Tensor:
    if buf.device.type != "cpu" or buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
        raise TypeError(f"a slot's data is a contiguous 1-d uint8 CPU tensor, not {buf.dtype} {tuple(buf.shape)} "
                        f"on {buf.device}")
    return buf


def of(algorithm: str, buf: torch.Tensor, value: int = 0) -> int:
    """The ``algorithm`` checksum of ``buf`` (a flat uint8 CPU tensor), continuing from ``value``."""
    buf = _flat(buf)
    if algorithm == CRC32:
        return zlib.crc32(buf.numpy().data, value)
    if algorithm != CRC32C:
        raise ValueError(f"unknown slot checksum {algorithm!r} (known: {CRC32!r}, {CRC32C!r})")
    mod = native()
    if mod is None:
        raise ValueError(f"the slot is checksummed with CRC-32C and its kernel is not available here ({reason})")
    return int(mod.crc32c(buf.data_ptr(), buf.numel(), value)) if buf.numel() else value


def copy_in(algorithm: str, buf: torch.Tensor, tensors: list[tuple[int, torch.Tensor]],
            after_each: Optional[Callable[[], None]] = None) -> int:
    """Copies each tensor's bytes to its offset in ``buf`` and returns the ``algorithm`` checksum of
    all of ``buf`` (the gaps between tensors included): with CRC-32C in the same pass as the copy
    (Note [slot checksum]), with crc32 in a second pass. ``after_each`` runs after each tensor's
    copy (the fault tests' kill point inside a copy, Note [kill points])."""
    buf = _flat(buf)
    mod = native() if algorithm == CRC32C else None
    if mod is None:
        with torch.no_grad():
            for off, t in tensors:
                n = t.numel() * t.element_size()
                buf[off:off + n].view(t.dtype).copy_(t.detach().reshape(-1))
                if after_each is not None:
                    after_each()
        return of(algorithm, buf)
    crc, pos, base, size = 0, 0, buf.data_ptr(), buf.numel()
    for off, t in sorted(tensors, key=lambda p: p[0]):
        n = t.numel() * t.element_size()
        if off < pos or off + n > size:
            raise ValueError(f"a tensor of {n} bytes at offset {off} overlaps the one before (ends at {pos}) "
                             f"or the slot's {size} bytes")
        if off > pos:
            crc = mod.crc32c(base + pos, off - pos, crc)
        src = t.detach()
        if n and src.device.type == "cpu" and src.is_contiguous() and not src.is_conj() and not src.is_neg():
            crc = mod.copy_crc32c(base + off, src.data_ptr(), n, crc)
        elif n:
            with torch.no_grad():
                buf[off:off + n].view(t.dtype).copy_(src.reshape(-1))
            crc = mod.crc32c(base + off, n, crc)
        pos = off + n
        if after_each is not None:
            after_each()
    if size > pos:
        crc = mod.crc32c(base + pos, size - pos, crc)
    return int(crc)
