"""Stage-3 units whose shard, fp32 master and gradient live in a swap file (ZeRO-Infinity).

``offload_params="nvme"`` (with ``offload_optimizer="nvme"``, whose ``NvmeOptimizerState``
keeps the Adam moments) leaves no per-parameter state in memory between uses: each unit's
tensors (``shard``, ``master`` when it is a separate fp32 copy, ``grad_store``) keep their
storage *objects* for the unit's whole life — every view of them (the inner optimizer's
runs, their ``.grad``) stays valid — but the storage is resized to 0 bytes while the unit
is *swapped out*, the scheme of Note [released parameters] in
zeroshard/stages/stage3/gatherer.py. ``fetch`` re-allocates and reads a part back,
``flush`` writes it, ``evict`` releases it again. Who fetches what, and when:

- the gatherer reads a unit's shard just before gathering it (prefetched with the gather)
  and drops it once copied into the gathered buffer;
- the gradient reducer reads the unit's gradient (only when accumulating onto an earlier
  micro-batch), adds the reduced gradient, and writes it back; the write completes in the
  background and the memory is released when it has;
- the optimizer step walks the units in order: unit ``i+1``'s master and gradient are read
  while unit ``i`` is updated, then unit ``i``'s new master (and its low-precision shard) is
  written back while the next one is updated;
- state dicts and checkpoints visit one unit at a time (``resident_runs``).

So host memory holds a few units, never the model: the point of "bigger than memory".

The file is allocated in full at construction (``posix_fallocate``): a disk that is too
small fails then, with the size needed, never in the middle of a step. Like the moments'
file it is scratch, named by rank and pid, and state comes back from checkpoints.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from typing import Any, Optional, Sequence

import torch

from zeroshard.io import AsyncIO
from zeroshard.offload.swap_file import aligned, create_swap_file
from zeroshard.optim.flat_unit import alloc_storage, free_storage, is_allocated

PARTS = ("shard", "master", "grad")


def unit_parts_bytes(numel: int, param_dtype: torch.dtype) -> dict[str, int]:
    """Bytes each swapped part of a unit owning ``numel`` elements takes in the file."""
    out = {"shard": aligned(numel * param_dtype.itemsize), "grad": aligned(numel * 4)}
    if param_dtype != torch.float32:
        out["master"] = aligned(numel * 4)
    return out


class NvmeUnitStore:
    def __init__(self, nvme_path: str, rank: int, total_bytes: int) -> None:
        self.file_bytes = total_bytes
        self.path = create_swap_file(nvme_path, "params", rank, total_bytes,
                                     "offload_params='nvme' needs {gib} GiB in {path!r} for this rank's "
                                     "parameter shards, master weights and gradients")
        self.aio = AsyncIO()
        self._next = 0
        self._regions: dict[tuple[int, str], int] = {}  # (id(unit), part) -> byte offset
        self._writes: list[tuple[Any, Any, tuple[str, ...]]] = []  # (handle, unit, parts to free)
        self._reads: dict[tuple[int, str], Any] = {}

    # -- layout ------------------------------------------------------------------------------
    @staticmethod
    def tensor_of(unit: Any, part: str) -> torch.Tensor:
        return {"shard": unit.shard, "master": unit.master, "grad": unit.grad_store}[part]

    @staticmethod
    def parts_of(unit: Any) -> tuple[str, ...]:
        return ("shard", "master", "grad") if unit.separate_master else ("shard", "grad")

    @staticmethod
    def state_parts(unit: Any) -> tuple[str, ...]:
        """What loading optimizer state into a unit touches: a separate master, and the
        low-precision shard rewritten from it (an fp32 master *is* the shard, written directly)."""
        return ("shard", "master") if unit.separate_master else ()

    def adopt(self, unit: Any) -> None:
        """Takes a freshly built unit: writes its shard (and master) to the file, releases
        every part, and from now on serves them."""
        sizes = unit_parts_bytes(unit.owned[1] - unit.owned[0], unit.dtype)
        for part in self.parts_of(unit):
            if self._next + sizes[part] > self.file_bytes:
                raise RuntimeError(f"swap file {self.path!r} sized {self.file_bytes} bytes is too small for "
                                   f"unit {unit.layout.index} (a zeroshard bug: the sizes disagree)")
            self._regions[(id(unit), part)] = self._next
            self._next += sizes[part]
        unit.swap = self
        if not unit.needs_init:
            handles = [self.aio.pwrite(self.tensor_of(unit, p), self.path, self._regions[(id(unit), p)])
                       for p in self.parts_of(unit) if p != "grad"]
            for h in handles:
                h.wait()
        for part in self.parts_of(unit):
            free_storage(self.tensor_of(unit, part))

    def _offset(self, unit: Any, part: str, a: Optional[int] = None) -> int:
        """Byte offset of ``part`` in the file, or of its element at unit offset ``a``."""
        base = self._regions[(id(unit), part)]
        return base if a is None else base + (a - unit.owned[0]) * self.tensor_of(unit, part).element_size()

    # -- residency -----------------------------------------------------------------------------
    def settle(self, unit: Optional[Any] = None) -> None:
        """Completes background writes (of ``unit``, or all) and releases what they wrote."""
        keep = []
        for h, u, parts in self._writes:
            if unit is None or u is unit:
                h.wait()
                for p in parts:
                    free_storage(self.tensor_of(u, p))
            else:
                keep.append((h, u, parts))
        self._writes = keep

    def fetch(self, unit: Any, parts: Iterable[str], skip_read: Iterable[str] = ()) -> None:
        """Starts reading ``parts`` of ``unit`` back into memory (``wait_fetch`` completes it).
        Parts in ``skip_read`` (about to be overwritten whole), and a gradient with no valid
        value (first micro-batch), are allocated, not read."""
        self.settle(unit)
        for part in parts:
            t = self.tensor_of(unit, part)
            if is_allocated(t) or (id(unit), part) in self._reads:
                continue
            alloc_storage(t)
            if part in skip_read or (part == "grad" and not unit.grad_valid):
                continue
            self._reads[(id(unit), part)] = self.aio.pread(t, self.path, self._offset(unit, part))

    def wait_fetch(self, unit: Any, parts: Iterable[str]) -> None:
        for part in parts:
            h = self._reads.pop((id(unit), part), None)
            if h is not None:
                h.wait()

    def load(self, unit: Any, parts: Iterable[str]) -> None:
        parts = tuple(parts)
        self.fetch(unit, parts)
        self.wait_fetch(unit, parts)

    def flush(self, unit: Any, parts: Iterable[str], release: bool = True) -> None:
        """Writes ``parts`` back in the background; with ``release`` their memory is freed once
        written (``settle``)."""
        parts = tuple(p for p in parts if is_allocated(self.tensor_of(unit, p)))
        for part in parts:
            h = self.aio.pwrite(self.tensor_of(unit, part), self.path, self._offset(unit, part))
            self._writes.append((h, unit, (part,) if release else ()))
        if len(self._writes) > 4 * len(PARTS):  # bound the memory waiting on writes
            oldest = self._writes[0][1]
            self.settle(oldest)

    def evict(self, unit: Any, parts: Iterable[str]) -> None:
        """Releases ``parts`` without writing (their file copy is current)."""
        for part in parts:
            self.wait_fetch(unit, (part,))
            free_storage(self.tensor_of(unit, part))

    @contextlib.contextmanager
    def resident(self, unit: Any, parts: Sequence[str], write: bool = False) -> Iterator[None]:
        """``parts`` of ``unit`` in memory inside the block; written back after it with ``write``."""
        parts = tuple(parts)
        was = {p for p in parts if is_allocated(self.tensor_of(unit, p)) and (id(unit), p) not in self._reads}
        self.load(unit, parts)
        try:
            yield
        finally:
            if write:
                self.flush(unit, parts, release=False)
                self.settle(unit)
            self.evict(unit, [p for p in parts if p not in was])

    @contextlib.contextmanager
    def sized(self, unit: Any) -> Iterator[None]:
        """Gives swapped-out parts their size (no data, no resident pages) so views of them
        can be made; views outlive the block and see the data whenever it is fetched."""
        empty = [p for p in self.parts_of(unit) if not is_allocated(self.tensor_of(unit, p))]
        for p in empty:
            alloc_storage(self.tensor_of(unit, p))
        try:
            yield
        finally:
            for p in empty:
                free_storage(self.tensor_of(unit, p))

    # -- ranges without residency ------------------------------------------------------------------
    def read_range(self, unit: Any, part: str, a: int, b: int) -> torch.Tensor:
        """A fresh tensor with unit range ``[a, b)`` of ``part`` (within the owned range)."""
        self.settle(unit)
        t = self.tensor_of(unit, part)
        out = torch.empty(b - a, dtype=t.dtype)
        if b > a:
            self.aio.pread(out, self.path, self._offset(unit, part, a)).wait()
        return out

    def write_range(self, unit: Any, part: str, a: int, values: torch.Tensor) -> None:
        self.settle(unit)
        t = self.tensor_of(unit, part)
        if is_allocated(t):  # a resident copy must agree with the file
            lo = unit.owned[0]
            t[a - lo:a - lo + values.numel()].copy_(values)
        src = values.detach().to(dtype=t.dtype, device="cpu").contiguous()
        if src.numel():
            self.aio.pwrite(src, self.path, self._offset(unit, part, a)).wait()

    def close(self) -> None:
        try:
            self.settle()
        finally:
            self.aio.close()
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def resident_runs(runs: Sequence[Any], write: bool = False) -> Iterator[Any]:
    """Yields ``runs`` in order with the parts of their unit that optimizer state involves
    (``state_parts``) in memory, one unit at a time, written back when the walk leaves a unit
    with ``write``. Units that are not swapped are untouched: callers use this on any optimizer."""
    current, ctx = None, None
    try:
        for run in runs:
            if run.unit is not current:
                if ctx is not None:
                    ctx.__exit__(None, None, None)
                    ctx = None
                current = run.unit
                store = getattr(current, "swap", None)
                if store is not None:
                    ctx = store.resident(current, store.state_parts(current), write)
                    ctx.__enter__()
            yield run
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
