"""Units whose fp32 master, gradient and (stage 3) shard live in a swap file.

``offload_optimizer="nvme"`` keeps a unit's gradient and its separate fp32 master (mixed
precision, or a master off the model's device) here, beside the Adam moments that
``NvmeOptimizerState`` streams; ``offload_params="nvme"`` (stage 3, ZeRO-Infinity) adds the
parameter shard, so no per-parameter state stays in memory between uses. The tensors
(``shard``, ``master``, ``grad_store``) keep their storage *objects* for the unit's whole
life — every view of them (the inner optimizer's runs, their ``.grad``) stays valid — but
the storage is resized to 0 bytes while the part is *swapped out*, the scheme of Note
[released parameters] in zeroshard/stages/stage3/gatherer.py. ``fetch`` re-allocates and
reads a part back, ``flush`` writes it, ``evict`` releases it again. Who fetches what, when:

- the gatherer reads a unit's shard just before gathering it (prefetched with the gather)
  and drops it once copied into the gathered buffer;
- the gradient reducer reads the unit's gradient (only when accumulating onto an earlier
  micro-batch), adds the reduced gradient, and writes it back; the write completes in the
  background and the memory is released when it has;
- the optimizer step walks the units in order: unit ``i+1``'s master and gradient are read
  while unit ``i`` is updated, then unit ``i``'s new master (and its low-precision shard) is
  written back while the next one is updated;
- state dicts and checkpoints visit one unit at a time (``resident_runs``);
- torch code touching a swapped part (``clip_grad_norm_`` over ``model.parameters()``, a
  look at ``p.grad``) reads the unit once and keeps it (Note [parts held for torch code]).

So host memory holds a few units, never the model: the point of "bigger than memory".

Each unit's region is allocated on disk (``posix_fallocate``) as the optimizer is built: a
disk that is too small fails then, with the size needed, never in the middle of a step.
Like the moments' file it is scratch, and state comes back from checkpoints; damage to it
while training is an error naming it (Note [guarded swap files] in ``swap_file.py``).

Note [parts held for torch code]: torch code reads and changes ``.grad`` one parameter at a
time (``torch.nn.utils.clip_grad_norm_`` takes a norm of each, then multiplies each by the
coefficient), and a unit holds many parameters. Reading the unit's part in and out per
op read each unit's gradient 2 x (parameters in it) times and wrote it once per parameter:
0.44 s of a 2.2 s LoRA step on 16 blocks. ``touched`` keeps the part in memory after the
op instead (the most recent, within the memory of ``max_in_flight`` units: what may wait on
writes), so torch's clip reads each unit once per pass over the parameters (norms, then the
multiplication), and once in all where the gradients fit that memory (a LoRA's adapters); a
part an op changed is *dirty*: its file copy is behind
until it leaves memory, when it is written (its noted norm is computed again then, once per
unit). Every way out of memory writes a dirty part first (``evict``, dropping it from the
held set, ``read_range``); gradients set to None are dropped unwritten, and each step
releases what is still held as it starts, on the caller's thread (a step in flight overlaps
the next forward's gathers).
"""
from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Optional, Sequence

import torch

from zeroshard.io import ALIGN
from zeroshard.offload.swap_file import SwapFile, aligned
from zeroshard.units.flat_unit import FlatUnit, alloc_storage, free_storage, is_allocated


class NvmeUnitStore:
    def __init__(self, nvme_path: str, rank: int, swap_shards: bool, max_in_flight: int = 3) -> None:
        self.swap_shards = swap_shards
        self.max_in_flight = max_in_flight
        """Units whose parts may wait on a write, or be read ahead, at once (the memory bound)."""
        self.file = SwapFile(nvme_path, "params" if swap_shards else "grads", rank)
        self.path = self.file.path
        self.what = ("offload_params='nvme' needs {gib} GiB for this rank's parameter shards, master weights "
                     "and gradients" if swap_shards else
                     "offload_optimizer='nvme' needs {gib} GiB for this rank's master weights and gradients")
        self.aio = self.file.aio
        self.file_bytes = 0
        self._parts: dict[int, tuple[str, ...]] = {}  # id(unit) -> the parts kept here
        self._regions: dict[tuple[int, str], int] = {}  # (id(unit), part) -> byte offset
        self._writes: list[tuple[Any, Any, tuple[str, ...]]] = []  # (handle, unit, parts to free)
        self._reads: dict[tuple[int, str], Any] = {}
        self._held: collections.OrderedDict[tuple[int, str], FlatUnit] = collections.OrderedDict()
        self._dirty: set[tuple[int, str]] = set()  # held parts torch code changed: the file is behind
        self._largest = 0  # bytes of the largest unit's swapped parts (what a unit in flight holds)
        self._lock = threading.RLock()
        self.gather_read = 0
        """Bytes of stage-3 shards read for gathers so far (``frozen_gather_read``: of frozen units,
        a LoRA base), and the seconds forward and backward waited on those reads
        (``gather_wait_s``): what ``placement_report()["measured_io"]`` shows of the gathers."""
        self.frozen_gather_read = 0
        self.gather_wait_s = 0.0
        self.cache: Optional[Any] = None
        """The parameter cache (``param_cache.ParamCache``) of automatic placement, if any."""
        self.before_close: list[Callable[[], None]] = []
        """Run once by ``close`` before the file goes: the optimizer's teardown, which may still
        read the shards (teardown.Teardown)."""

    # -- layout ------------------------------------------------------------------------------
    @staticmethod
    def tensor_of(unit: FlatUnit, part: str) -> torch.Tensor:
        return {"shard": unit.shard, "master": unit.master, "grad": unit.grad_store}[part]

    def parts_of(self, unit: FlatUnit) -> tuple[str, ...]:
        return self._parts[id(unit)]

    def swaps(self, unit: FlatUnit, part: str) -> bool:
        return part in self._parts.get(id(unit), ())

    def state_parts(self, unit: FlatUnit) -> tuple[str, ...]:
        """What loading optimizer state into a unit touches: a separate master, and a swapped
        low-precision shard rewritten from it (an fp32 master *is* the shard, written directly)."""
        return tuple(p for p in ("shard", "master") if unit.separate_master and self.swaps(unit, p))

    def adopt(self, unit: FlatUnit, parts: Optional[Sequence[str]] = None) -> None:
        """Takes a freshly built unit: reserves its region, writes its shard (and master) to
        the file, releases every swapped part, and from now on serves them. ``parts`` (the
        automatic placement's choice for this unit) defaults to what the options give every
        unit; calls naming parts the unit does not swap do nothing for those parts."""
        if parts is None:
            parts = (("shard",) if self.swap_shards else ()) + (("master",) if unit.separate_master else ()) + ("grad",)
        if unit.frozen:  # (only weights: no master, no gradient)
            parts = ("shard",) if self.swap_shards else ()
            if not parts:
                return
        parts = tuple(parts)
        self._parts[id(unit)] = parts
        start = self.file_bytes
        self._largest = max(self._largest, sum(self.tensor_of(unit, p).numel() * self.tensor_of(unit, p).element_size()
                                               for p in parts))
        for part in parts:
            t = self.tensor_of(unit, part)
            self._regions[(id(unit), part)] = self.file_bytes
            self.file_bytes += aligned(t.numel() * t.element_size())
        self.file.reserve(start, self.file_bytes - start, self.what)
        unit.swap = self
        if not unit.needs_init:
            handles = [self.file.pwrite(self.tensor_of(unit, p), self._regions[(id(unit), p)])
                       for p in parts if p != "grad"]
            for h in handles:
                h.wait()
        for part in parts:
            free_storage(self.tensor_of(unit, part))

    def re_adopt(self, unit: FlatUnit, parts: Sequence[str]) -> None:
        """Keeps ``parts`` of ``unit`` here from now on instead of what it kept (nothing for a unit
        never adopted), at the first forward (Note [state re-placed at the first forward] in
        zeroshard/offload/placement_replan.py): parts leaving are read back into memory and their
        regions forgotten (the file, scratch, keeps the space), parts arriving get a region at the
        file's end, are written there (a gradient only once it has a value) and leave memory."""
        old, parts = self._parts.get(id(unit), ()), tuple(parts)
        if parts == old:
            return
        with self._lock:
            self.settle(unit)
            leaving = [p for p in old if p not in parts]
            for part in leaving:
                self._drop_held((id(unit), part))
            self.load(unit, leaving)  # (a gradient with no value yet is allocated, not read)
            for part in leaving:
                del self._regions[(id(unit), part)]
            arriving = [p for p in parts if p not in old]
            start = self.file_bytes
            for part in arriving:
                t = self.tensor_of(unit, part)
                self._regions[(id(unit), part)] = self.file_bytes
                self.file_bytes += aligned(t.numel() * t.element_size())
            self.file.reserve(start, self.file_bytes - start, self.what)
            if parts:
                self._parts[id(unit)] = parts
            else:
                self._parts.pop(id(unit), None)
            unit.swap = self if parts else None
            self._largest = max(self._largest, sum(self.tensor_of(unit, p).numel() * self.tensor_of(unit, p)
                                                   .element_size() for p in parts))
            for h in [self.file.pwrite(self.tensor_of(unit, p), self._regions[(id(unit), p)])
                      for p in arriving if (p != "grad" or unit.grad_valid) and is_allocated(self.tensor_of(unit, p))]:
                h.wait()
            for part in arriving:
                free_storage(self.tensor_of(unit, part))

    def _offset(self, unit: FlatUnit, part: str, a: Optional[int] = None) -> int:
        """Byte offset of ``part`` in the file, or of its element at unit offset ``a``."""
        base = self._regions[(id(unit), part)]
        if a is None:
            return base
        first = unit.grad_base if part == "grad" else unit.owned[0]
        return base + (a - first) * self.tensor_of(unit, part).element_size()

    # -- residency -----------------------------------------------------------------------------
    def settle(self, unit: Optional[FlatUnit] = None) -> None:
        """Completes background writes (of ``unit``, or all) and releases what they wrote."""
        with self._lock:  # an asynchronous checkpoint save reads from another thread
            keep = []
            for h, u, parts in self._writes:
                if unit is None or u is unit:
                    h.wait()
                    for p in parts:
                        free_storage(self.tensor_of(u, p))
                else:
                    keep.append((h, u, parts))
            self._writes = keep

    def fetch(self, unit: FlatUnit, parts: Iterable[str], skip_read: Iterable[str] = (), urgent: bool = False) -> None:
        """Starts reading ``parts`` of ``unit`` back into memory (``wait_fetch`` completes it).
        Parts in ``skip_read`` (about to be overwritten whole), and a gradient with no valid
        value (first micro-batch), are allocated, not read. ``urgent``: a gather's read, past
        the queue of a step in flight (``SwapFile.pread``)."""
        self.settle(unit)
        for part in parts:
            t = self.tensor_of(unit, part)
            if not self.swaps(unit, part) or is_allocated(t) or (id(unit), part) in self._reads:
                continue
            alloc_storage(t)
            if part in skip_read or (part == "grad" and not unit.grad_valid):
                continue
            self._reads[(id(unit), part)] = self.file.pread(t, self._offset(unit, part), urgent=urgent)

    def wait_fetch(self, unit: FlatUnit, parts: Iterable[str]) -> None:
        for part in parts:
            h = self._reads.pop((id(unit), part), None)
            if h is not None:
                h.wait()

    def load(self, unit: FlatUnit, parts: Iterable[str]) -> None:
        parts = tuple(parts)
        self.fetch(unit, parts)
        self.wait_fetch(unit, parts)

    def flush(self, unit: FlatUnit, parts: Iterable[str], release: bool = True) -> None:
        """Writes ``parts`` back in the background; with ``release`` their memory is freed once
        written (``settle``)."""
        parts = tuple(p for p in parts if self.swaps(unit, p) and is_allocated(self.tensor_of(unit, p)))
        with self._lock:
            for part in parts:
                self._dirty.discard((id(unit), part))
                if release:
                    self._held.pop((id(unit), part), None)
                h = self.file.pwrite(self.tensor_of(unit, part), self._offset(unit, part))
                self._writes.append((h, unit, (part,) if release else ()))
            # Bound the memory waiting on writes to about one unit's parts: enough to overlap
            # a write with the next unit's work, never a backward's worth of gradients.
            while len(self._writes) > self.max_in_flight:
                self.settle(self._writes[0][1])

    def evict(self, unit: FlatUnit, parts: Iterable[str]) -> None:
        """Releases ``parts`` without writing (their file copy is current); a gather's read of
        the shard into the gathered buffer completes first (that memory is about to go)."""
        if "shard" in parts:
            h = self._reads.pop((id(unit), "gather"), None)
            if h is not None:
                h.wait()
        for part in parts:
            if self.swaps(unit, part):
                self.wait_fetch(unit, (part,))
                if (id(unit), part) in self._dirty:  # (torch code changed it while held: write it first)
                    self._drop_held((id(unit), part))
                    continue
                self._held.pop((id(unit), part), None)
                free_storage(self.tensor_of(unit, part))

    def gathered(self, unit: FlatUnit, backward: bool) -> None:
        """The gatherer copied the shard into the gathered buffer: drop it, unless the parameter
        cache keeps it for the backward gather (``param_cache.py``)."""
        if self.cache is None or not self.cache.keep(unit, backward):
            self.evict(unit, ("shard",))

    # -- a gather's shard ---------------------------------------------------------------------------
    def fetch_for_gather(self, unit: FlatUnit, dest: torch.Tensor, backward: bool) -> None:
        """Starts reading the shard for a gather into ``dest`` (the owned range of the gathered
        buffer) when it is not in memory, the cache will not keep it and ``dest`` is aligned for
        O_DIRECT: no shard allocation and no copy. Otherwise it is read into the shard as by
        ``fetch``, and ``finish_gather`` copies it."""
        self.settle(unit)  # (a write of the shard still in flight: read what it wrote)
        keep = self.cache is not None and self.cache.keep(unit, backward)
        resident = is_allocated(unit.shard) and (id(unit), "shard") not in self._reads
        if not resident:  # (a shard the cache kept, or still in memory, is read by no one)
            self.gather_read += dest.numel() * dest.element_size()
            if unit.frozen:
                self.frozen_gather_read += dest.numel() * dest.element_size()
        if keep or is_allocated(unit.shard) or (id(unit), "shard") in self._reads or dest.data_ptr() % ALIGN:
            self.fetch(unit, ("shard",), urgent=True)
            return
        self._reads[(id(unit), "gather")] = self.file.pread(dest, self._offset(unit, "shard"), urgent=True)

    def finish_gather(self, unit: FlatUnit, dest: torch.Tensor, backward: bool) -> None:
        """``dest`` holds the shard once this returns (see ``fetch_for_gather``)."""
        h = self._reads.pop((id(unit), "gather"), None)
        t0 = time.perf_counter()
        if h is None:
            self.wait_fetch(unit, ("shard",))
            self.gather_wait_s += time.perf_counter() - t0
            dest.copy_(unit.shard)
            self.gathered(unit, backward)
            return
        h.wait()
        self.gather_wait_s += time.perf_counter() - t0
        if self.cache is not None and self.cache.keep(unit, backward):  # (grad mode changed since the read began)
            alloc_storage(unit.shard)
            unit.shard.copy_(dest)

    @contextlib.contextmanager
    def resident(self, unit: FlatUnit, parts: Sequence[str], write: bool = False) -> Iterator[None]:
        """``parts`` of ``unit`` in memory inside the block; written back after it with ``write``."""
        parts = tuple(parts)
        with self._lock:  # resident before, and staying so (not just waiting on a write)
            leaving = {p for _, u, ps in self._writes if u is unit for p in ps}
        was = {p for p in parts if is_allocated(self.tensor_of(unit, p))
               and (id(unit), p) not in self._reads and p not in leaving}
        self.load(unit, parts)
        try:
            yield
        finally:
            if write:
                self.flush(unit, parts, release=False)
                self.settle(unit)
            self.evict(unit, [p for p in parts if p not in was])

    # -- parts held for torch code (Note [parts held for torch code]) -----------------------------
    @contextlib.contextmanager
    def touched(self, unit: FlatUnit, part: str, write: bool) -> Iterator[None]:
        """``part`` of ``unit`` in memory for one torch op on a ``ShardedTensor`` view of it, and
        kept there afterwards (the most recent parts); ``write``: the op
        changed it, so the file is behind until the part is written (when it leaves). Held
        parts take at most the memory of ``max_in_flight`` units in flight (oldest leave first)."""
        key = (id(unit), part)
        self.load(unit, (part,))
        try:
            yield
        finally:
            with self._lock:
                if write:
                    self._dirty.add(key)
                self._held[key] = unit
                self._held.move_to_end(key)
                while len(self._held) > 1 and self._held_bytes() > self.max_in_flight * self._largest:
                    self._drop_held(next(iter(self._held)))

    def _held_bytes(self) -> int:
        return sum(self.tensor_of(u, k[1]).numel() * self.tensor_of(u, k[1]).element_size()
                   for k, u in self._held.items())

    def _drop_held(self, key: tuple[int, str]) -> None:
        unit = self._held.pop(key, None)
        if unit is None:
            return
        part = key[1]
        if not is_allocated(self.tensor_of(unit, part)):  # (released meanwhile, by a step's write)
            self._dirty.discard(key)
            return
        if key in self._dirty:
            if part == "grad" and unit.grad_stats is None and unit.grad_valid:
                unit.note_grad_stats()  # (one pass per unit, not per op: Note [parts held for torch code])
            self.flush(unit, (part,))
        else:
            free_storage(self.tensor_of(unit, part))

    def forget(self, unit: FlatUnit, part: str) -> None:
        """``part``'s value is gone (gradients set to None): a held copy is dropped unwritten."""
        key = (id(unit), part)
        with self._lock:
            self._dirty.discard(key)
            if self._held.pop(key, None) is not None:
                self.settle(unit)  # (a write of it may still be in flight)
                if is_allocated(self.tensor_of(unit, part)):
                    free_storage(self.tensor_of(unit, part))

    def release_held(self) -> None:
        """Writes what torch code changed and releases every held part (as a step starts)."""
        with self._lock:
            for key in list(self._held):
                self._drop_held(key)

    @contextlib.contextmanager
    def sized(self, unit: FlatUnit) -> Iterator[None]:
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
    def read_range(self, unit: FlatUnit, part: str, a: int, b: int) -> torch.Tensor:
        """A fresh tensor with unit range ``[a, b)`` of ``part`` (within the owned range)."""
        if (id(unit), part) in self._dirty:
            self.flush(unit, (part,), release=False)
        self.settle(unit)
        t = self.tensor_of(unit, part)
        out = torch.empty(b - a, dtype=t.dtype)  # (CPU: the swap file feeds host memory)
        if b > a:
            self.file.pread(out, self._offset(unit, part, a)).wait()
        return out

    def write_range(self, unit: FlatUnit, part: str, a: int, values: torch.Tensor) -> None:
        self.settle(unit)
        t = self.tensor_of(unit, part)
        if is_allocated(t):  # a resident copy must agree with the file
            lo = unit.owned[0]
            t[a - lo:a - lo + values.numel()].copy_(values)
        src = values.detach().to(dtype=t.dtype, device="cpu").contiguous()
        if src.numel():
            self.file.pwrite(src, self._offset(unit, part, a)).wait()

    def close(self) -> None:
        run, self.before_close = self.before_close, []
        for action in run:
            action()
        try:
            self.settle()
        except OSError:  # closing discards the file: a failed write there loses nothing
            pass
        finally:
            self.file.close()


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
