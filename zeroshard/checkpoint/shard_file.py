"""One checkpoint data file: safetensors bytes written with block checksums, read back by range.

The file is plain safetensors (``safe_open`` and ``transformers`` read it), but written and
read by this module so that:
- the checksum is computed *while* writing, on a second thread, so a save costs one pass
  over the data at disk speed (zlib.crc32 releases the GIL and runs at ~4 GB/s here;
  blake2b at ~0.9 GB/s would be the bottleneck);
- checksums are per block of ``BLOCK`` bytes, so a loader that needs a few ranges of a file
  (resharding) verifies only the blocks it reads, not the whole file;
- nothing is trusted: the header length, every entry's dtype, shape and offsets are checked
  against the file size and the manifest before a byte of tensor data is allocated.
"""
from __future__ import annotations

import ctypes
import functools
import itertools
import json
import os
import queue
import struct
import sys
import threading
import zlib
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch

from zeroshard.checkpoint.direct_io import DirectWriter, aligned_empty, read_into
from zeroshard.checkpoint.checkpoint_errors import CheckpointCorruptError
from zeroshard.checkpoint.safe_fs import parse_json, read_small, regular_size

BLOCK = 32 << 20
"""Checksum granularity in bytes: large enough that crc bookkeeping is noise, small enough
that a reshard reading a few pieces does not read much more than it needs."""
_CHUNK = 16 << 20  # bytes per write()/readinto() call
_MAX_HEADER = 100 << 20
# Four readers, each reading then checksumming a whole block: four large requests in flight
# (the virtual disk needs depth to reach its rate) and the crc32s of two blocks running
# while others are read. A cold-cache load of 2 GB on the 2-core VM: 1.07-1.48 GB/s with 2
# workers, 1.66-2.01 with 4, no better with 6 or 8 (docs/results.md, Checkpoints).
_IO_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="zeroshard-read")

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
          "U8": torch.uint8, "BOOL": torch.bool}
CODES = {v: k for k, v in DTYPES.items()}
# A complex parameter is stored as its reals, ``(*shape, 2)`` of F32/F64; its manifest entry adds
# "complex_dtype" (Note [complex parameters] in zeroshard/layout/unit_layout.py).
COMPLEX_DTYPES = {"C64": torch.complex64, "C128": torch.complex128}
COMPLEX_CODES = {v: k for k, v in COMPLEX_DTYPES.items()}


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw little-endian bytes of a contiguous CPU tensor, without a copy."""
    t = t.detach().contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    # numpy has no bfloat16: view the storage as bytes instead.
    return t.reshape(-1).view(torch.uint8).numpy().data  # 1-D, so len() counts bytes


class _Checksummer:
    """Per-block crc32 of a byte stream fed in order, computed on a worker thread."""

    def __init__(self) -> None:
        self.block = BLOCK  # read once: the size the manifest will record
        self.crcs: list[int] = []
        self._crc, self._filled = 0, 0
        self._q: "queue.Queue[Optional[memoryview]]" = queue.Queue(maxsize=2)
        self._thread = threading.Thread(target=self._run, name="zeroshard-crc", daemon=True)
        self._thread.start()

    def feed(self, data: memoryview) -> None:
        self._q.put(data)

    def _run(self) -> None:
        while (data := self._q.get()) is not None:
            while len(data):
                take = min(len(data), self.block - self._filled)
                self._crc = zlib.crc32(data[:take], self._crc)
                self._filled += take
                data = data[take:]
                if self._filled == self.block:
                    self.crcs.append(self._crc)
                    self._crc, self._filled = 0, 0

    def finish(self) -> list[int]:
        self._q.put(None)
        self._thread.join()
        if self._filled:
            self.crcs.append(self._crc)
        return self.crcs


@dataclass(frozen=True)
class WrittenFile:
    name: str
    bytes: int
    crc32: list[int]
    block_size: int

    def to_json(self) -> dict:
        return {"bytes": self.bytes, "block_size": self.block_size, "crc32": self.crc32}


def header_bytes(specs: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: Optional[dict[str, str]] = None) -> tuple[bytes, int]:
    """The safetensors prefix (length + JSON header) for tensors laid out back to back, and
    the number of data bytes that must follow."""
    header: dict = {"__metadata__": metadata or {}}
    offset = 0
    for key, dtype, shape in specs:
        code = CODES.get(dtype) or ("C64" if dtype == torch.complex64 else None)  # (an export's complex64)
        if code is None:
            raise TypeError(f"tensor {key!r} has dtype {dtype}, which safetensors cannot store")
        n = dtype.itemsize
        for d in shape:
            n *= d
        header[key] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data start to 8 bytes
    return struct.pack("<Q", len(raw)) + raw, offset


def write_stream(path: str, head: bytes, chunks: Iterable[memoryview],
                 on_chunk: Optional[Callable[[], None]] = None) -> WrittenFile:
    """Writes ``head`` then every chunk, fsynced, checksumming on a second thread. Chunks are
    consumed one at a time, so a producer may stream data it builds piece by piece."""
    summer = _Checksummer()
    writer = DirectWriter(path)
    ok = False
    try:
        for data in itertools.chain([memoryview(head)], chunks):
            for i in range(0, len(data), _CHUNK):
                chunk = data[i:i + _CHUNK]
                summer.feed(chunk)
                writer.write(chunk)
                if on_chunk is not None:
                    on_chunk()
        ok = True
    finally:
        crcs = summer.finish()
        writer.close(abort=not ok)
    written = writer.size
    return WrittenFile(os.path.basename(path), written, crcs, summer.block)


@dataclass(frozen=True)
class Deferred:
    """A tensor that is read only when the writer reaches it (state in a swap file), so a
    checkpoint of offloaded state streams through memory instead of materialising in it."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    read: Callable[[], torch.Tensor]


def _materialize(t: "torch.Tensor | Deferred") -> torch.Tensor:
    if isinstance(t, Deferred):
        out = t.read()
        if out.dtype != t.dtype or tuple(out.shape) != t.shape:
            raise RuntimeError(f"deferred tensor read {out.dtype}{list(out.shape)}, expected "
                               f"{t.dtype}{list(t.shape)} (a zeroshard bug)")
        return out
    return t.cpu()


def write_shard(path: str, tensors: Iterable[tuple[str, "torch.Tensor | Deferred"]],
                metadata: Optional[dict[str, str]] = None,
                on_chunk: Optional[Callable[[], None]] = None) -> WrittenFile:
    """Writes ``tensors`` (CPU, any layout) as one safetensors file, fsynced; returns its size
    and block checksums. Raises OSError (e.g. ENOSPC), leaving the partial file for the
    caller's cleanup of the temporary directory."""
    items = [(k, t if isinstance(t, Deferred) else t.detach()) for k, t in tensors]
    head, _ = header_bytes([(k, t.dtype, tuple(t.shape)) for k, t in items], metadata)
    return write_stream(path, head, (tensor_bytes(_materialize(t)) for _, t in items), on_chunk)


def write_json(path: str, obj: object) -> WrittenFile:
    """A small JSON file, fsynced, with its checksum (one block)."""
    raw = json.dumps(obj, separators=(",", ":"), allow_nan=True).encode()
    with open(path, "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    return WrittenFile(os.path.basename(path), len(raw), [zlib.crc32(raw)], max(1, len(raw)))  # one block


def read_json(path: str, expect: dict) -> object:
    """Reads a small JSON file written by ``write_json`` after checking size and checksum
    (``expect`` is its validated manifest entry)."""
    raw = read_small(path, int(expect["bytes"]))
    if len(raw) != expect["bytes"] or [zlib.crc32(raw)] != list(expect["crc32"]):
        raise CheckpointCorruptError(f"{path}: size or checksum differs from the manifest (file damaged)")
    return parse_json(raw, path)


@dataclass(frozen=True)
class Entry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in the file
    end: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class ShardReader:
    """Validated, range-addressable view of one data file; ``load(ranges)`` reads and verifies
    the blocks those ranges touch, after which ``get`` slices tensors out without I/O."""

    def __init__(self, path: str, expect: dict, max_blocks: Optional[int] = None) -> None:
        self.path = path
        self.max_blocks = max_blocks  # None: keep every block read (a load applies them all)
        self.bytes_read = 0
        self.size = int(expect["bytes"])
        self.block = int(expect["block_size"])
        self.crcs = list(expect["crc32"])
        if self.block <= 0 or len(self.crcs) != -(-self.size // self.block):
            raise CheckpointCorruptError(f"{path}: manifest gives {len(self.crcs)} checksums of "
                                         f"{self.block}-byte blocks for {self.size} bytes")
        actual = regular_size(path)
        if actual != self.size:
            raise CheckpointCorruptError(f"{path} has {actual} bytes, the manifest says {self.size}: "
                                         f"the file is {'truncated' if actual < self.size else 'damaged'}")
        # block index -> (verified buffer holding it, file offset of that buffer's byte 0)
        self._buffers: "OrderedDict[int, tuple[torch.Tensor, int]]" = OrderedDict()
        self._adopted: dict[int, tuple[torch.Tensor, list[tuple[int, int]]]] = {}  # id(buffer) -> spans
        self.entries = self._parse_header()
        self.bytes_read = 0  # data blocks only, from here on (the header is metadata)

    def _parse_header(self) -> dict[str, Entry]:
        if self.size < 8:
            raise CheckpointCorruptError(f"{self.path} has {self.size} bytes: too short for a safetensors header")
        head = aligned_empty(8)
        if read_into(self.path, 0, head) != 8:
            raise CheckpointCorruptError(f"{self.path}: file shrank while reading its header")
        (n,) = struct.unpack("<Q", head.numpy().tobytes())
        if n > min(_MAX_HEADER, self.size - 8):
            raise CheckpointCorruptError(f"{self.path}: header length {n} exceeds the file")
        # The header is covered by the first block(s): verify before trusting it (all of
        # them at once, even for a reader that keeps fewer blocks later).
        bound, self.max_blocks = self.max_blocks, None
        try:
            self.load([(0, 8 + n)])
            raw = self._bytes(8, 8 + n)
        finally:
            self.max_blocks = bound
            while bound is not None and len(self._buffers) > bound:
                self._buffers.popitem(last=False)
        header = parse_json(raw, self.path)
        if not isinstance(header, dict):
            raise CheckpointCorruptError(f"{self.path}: the header is a {type(header).__name__}, not an object")
        entries = {}
        for key, e in header.items():
            if key == "__metadata__":
                continue
            entry = self._entry(key, e, 8 + n)
            entries[key] = entry
        # safetensors refuses overlapping entries: two keys reading the same bytes is not a file it wrote
        spans = sorted((e.begin, e.end, k) for k, e in entries.items() if e.end > e.begin)
        for (_, end, k1), (begin, _, k2) in zip(spans, spans[1:]):
            if begin < end:
                raise CheckpointCorruptError(f"{self.path}: entries {k1!r} and {k2!r} overlap; the file is not "
                                             "a valid safetensors file")
        return entries

    def _entry(self, key: str, e: object, data_start: int) -> "Entry":
        if not isinstance(e, dict) or not (
                isinstance(e.get("dtype"), str) and e["dtype"] in DTYPES and
                isinstance(e.get("shape"), list) and len(e["shape"]) <= 16 and
                all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= self.size for d in e["shape"]) and
                isinstance(e.get("data_offsets"), list) and len(e["data_offsets"]) == 2 and
                all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= self.size for x in e["data_offsets"])):
            raise CheckpointCorruptError(f"{self.path}: malformed header entry {key!r}: {str(e)[:200]}")
        a, b = (x + data_start for x in e["data_offsets"])
        entry = Entry(DTYPES[e["dtype"]], tuple(e["shape"]), a, b)
        if not data_start <= a <= b <= self.size or b - a != entry.numel * entry.dtype.itemsize:
            raise CheckpointCorruptError(f"{self.path}: entry {key!r} (shape {list(entry.shape)}, bytes "
                                         f"[{a}, {b})) does not fit the file of {self.size} bytes")
        return entry

    def _bytes(self, a: int, b: int) -> bytes:
        """Bytes ``[a, b)`` of the file from verified blocks."""
        out = bytearray()
        pos = a
        while pos < b:
            buf, base = self._buffers[pos // self.block]
            take = min(b, (pos // self.block + 1) * self.block) - pos
            out += buf[pos - base:pos - base + take].numpy().tobytes()
            pos += take
        return bytes(out)

    def check_piece(self, name: str, p: dict, dtype: str) -> None:
        """Each entry a manifest piece names exists here with the piece's element count, and
        a parameter entry has the tensor's dtype (a master: fp32), so nothing is reinterpreted."""
        for kind, key in p["keys"].items():
            e = self.entries.get(key)
            want = DTYPES[dtype] if kind == "param" else torch.float32 if kind == "master" else None
            if e is None or e.numel != p["stop"] - p["start"] or want is not None and e.dtype != want:
                raise CheckpointCorruptError(
                    f"{self.path}: entry {key!r} for {name}[{p['start']}:{p['stop']}] is missing or has the "
                    f"wrong size or dtype ({'absent' if e is None else f'{CODES[e.dtype]}, {e.numel} elements'})")

    def load(self, byte_ranges: Iterable[tuple[int, int]]) -> None:
        """Reads and verifies every block touched by ``byte_ranges``, contiguous runs at once."""
        wanted = sorted({i for a, b in byte_ranges if b > a
                         for i in range(a // self.block, (b - 1) // self.block + 1)} - set(self._buffers))
        runs: list[list[int]] = []
        cap = self.max_blocks or len(self.crcs) or 1  # a bounded reader also reads in bounded runs
        for i in wanted:
            if runs and runs[-1][1] == i and i - runs[-1][0] < cap:
                runs[-1][1] = i + 1
            else:
                runs.append([i, i + 1])
        for first, last in runs:
            # A run right after the header's block 0 (read alone to verify the header) takes it
            # in: then no piece straddles two buffers, and ``get`` returns views, not copies.
            held = self._buffers.get(0)
            if first == 1 and self.max_blocks is None and held is not None and held[0].numel() == self.block:
                first = 0
            self._read_run(first, last)

    def _read_run(self, first: int, last: int) -> None:
        # Aligned torch.empty, not bytearray: O_DIRECT reads, and no memset of memory the read
        # overwrites anyway. The pool's workers each read a whole block and checksum it, so
        # crcs run while other blocks are read (both release the GIL) with the disk kept busy.
        start, stop = first * self.block, min(last * self.block, self.size)
        buf = aligned_empty(stop - start)
        self.bytes_read += sum(min((i + 1) * self.block, self.size) - i * self.block
                               for i in range(first, last) if i not in self._buffers)

        def read_block(i: int) -> Optional[str]:
            lo, hi = (i - first) * self.block, min((i + 1 - first) * self.block, stop - start)
            if i in self._buffers:  # verified already (see ``load``): a memory copy, not a read
                held, base = self._buffers[i]
                buf[lo:hi].copy_(held[start + lo - base:start + hi - base])
                return None
            if read_into(self.path, start + lo, buf[lo:hi]) != hi - lo:
                return f"{self.path}: file shrank while reading at byte {start + lo}"
            if zlib.crc32(buf[lo:hi].numpy().data) != self.crcs[i]:
                return (f"{self.path}: checksum mismatch in bytes [{start + lo}, {start + hi}): "
                        "the file is damaged; restore it or load an earlier step")
            return None
        crcs = list(zip(range(first, last), _IO_POOL.map(read_block, range(first, last))))
        for _, error in crcs:
            if error is not None:
                raise CheckpointCorruptError(error)
        for i, _ in crcs:
            self._buffers[i] = (buf, start)
            if self.max_blocks is not None and len(self._buffers) > self.max_blocks:
                self._buffers.popitem(last=False)

    def byte_range(self, key: str, lo: int, hi: int) -> tuple[int, int]:
        e = self.entries[key]
        s = e.dtype.itemsize
        return e.begin + lo * s, e.begin + hi * s

    def get(self, key: str, lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of entry ``key`` (flattened), from verified blocks: a view of
        the read buffer when one buffer holds them at an aligned offset, else a copy."""
        e = self.entries[key]
        a, b = self.byte_range(key, lo, hi)
        if b == a:
            return torch.empty(0, dtype=e.dtype)
        first, last = a // self.block, (b - 1) // self.block
        if self.max_blocks is None:  # bounded readers (export) go block by block below
            for i in (first, last):
                if i not in self._buffers:
                    self.load([(a, b)])
        buf, base = self._buffers.get(first, (None, 0))
        if buf is not None and self._buffers.get(last, (None,))[0] is buf and all(self._buffers.get(i, (None,))[0] is buf for i in range(first, last)):
            if (a - base) % e.dtype.itemsize == 0:
                return buf[a - base:b - base].view(e.dtype)
            return buf[a - base:b - base].clone().view(e.dtype)
        out = torch.empty(b - a, dtype=torch.uint8)
        pos = a
        while pos < b:  # spans separately read buffers: stitch block by block
            i = pos // self.block
            if i not in self._buffers:
                self.load([(pos, min(b, (i + 1) * self.block))])
            buf, base = self._buffers[i]
            take = min(b, (i + 1) * self.block) - pos
            out[pos - a:pos - a + take].copy_(buf[pos - base:pos - base + take])
            pos += take
        return out.view(e.dtype)

    def adopt(self, ranges: list[tuple[int, int]], dtype: torch.dtype) -> Optional[torch.Tensor]:
        """File byte ranges that follow one another, as one view of the verified buffer holding
        them all, to keep (None where they are not adjacent, span two buffers or are not
        aligned to ``dtype``). ``release`` then gives back the rest of that buffer's pages."""
        a, b = ranges[0][0], ranges[-1][1]
        if self.max_blocks is not None or b <= a or any(x[1] != y[0] for x, y in zip(ranges, ranges[1:])):
            return None
        held = [self._buffers.get(i) for i in range(a // self.block, (b - 1) // self.block + 1)]
        first = held[0]
        if first is None or any(h is None or h[0] is not first[0] for h in held):
            return None
        buf, base = first
        if (a - base) % dtype.itemsize or (b - a) % dtype.itemsize:
            return None
        self._adopted.setdefault(id(buf), (buf, []))[1].append((a - base, b - base))
        # A tensor of its own storage over those bytes (keeping the buffer alive), not a view
        # of the buffer's: storage sizes are what memory reports count.
        return torch.frombuffer(buf[a - base:b - base].numpy().data, dtype=dtype)

    def release(self, defer: bool = False) -> None:
        """Drops the read buffers; ``defer``: on the reaper thread, since unmapping gigabytes
        takes ~0.15 s/GB here (page by page) and needs no GIL: the caller goes on meanwhile.
        A buffer with adopted views stays mapped, its pages outside them given back."""
        trims = [functools.partial(_give_back_outside, buf, spans) for buf, spans in self._adopted.values()]
        self._adopted.clear()
        if defer and (self._buffers or trims):
            _reaper().put(trims + list(self._buffers.values()))
        else:
            for trim in trims:
                trim()
        self._buffers.clear()


def reap(objects: list) -> None:
    """Drops ``objects`` (the caller's last references to big tensors) on the reaper thread."""
    if objects:
        _reaper().put(list(objects))
    objects.clear()


_REAPERS: dict[int, "queue.Queue[list]"] = {}
_REAPER_LOCK = threading.Lock()


def _run_and_drop(batch: list) -> None:
    """Calls the callables of ``batch`` (page trims); its other items die on return (a loop
    variable of ``reap`` itself would keep the last buffer alive until the next batch)."""
    for item in batch:
        if callable(item):
            item()


def _reaper() -> "queue.Queue[list]":
    """This process's freeing thread (started on first use, and again in a forked child,
    which inherits the queue but not the thread)."""
    pid = os.getpid()
    with _REAPER_LOCK:
        if pid not in _REAPERS:
            q: "queue.Queue[list]" = queue.Queue()

            def reap() -> None:
                while True:
                    _run_and_drop(q.get())  # the last references die there: the unmapping runs on this thread
            threading.Thread(target=reap, name="zeroshard-free", daemon=True).start()
            _REAPERS.clear()
            _REAPERS[pid] = q
        return _REAPERS[pid]


_MADV_DONTNEED = 4  # Linux
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _give_back_outside(buf: torch.Tensor, spans: list[tuple[int, int]]) -> None:
    """Returns to the system the whole pages of ``buf`` outside ``spans`` (byte ranges still
    viewed), which nothing reads again: the bytes a load copied elsewhere, next to the state
    it adopted. Without this, the adopted views would keep the copied bytes resident."""
    if _LIBC is None:
        return
    edges = [0] + [x for span in sorted(spans) for x in span] + [buf.numel()]
    for lo, hi in zip(edges[::2], edges[1::2]):
        start = -(-(buf.data_ptr() + lo) // _PAGE) * _PAGE
        stop = (buf.data_ptr() + hi) // _PAGE * _PAGE
        if stop - start >= 16 * _PAGE:
            _LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(stop - start), _MADV_DONTNEED)


def verify_file(path: str, expect: dict) -> None:
    """Streams a whole data file through its block checksums (memory: one read chunk, not
    one block); raises CheckpointCorruptError."""
    size, block, crcs = regular_size(path), int(expect["block_size"]), expect["crc32"]
    if size != expect["bytes"]:
        raise CheckpointCorruptError(f"{path} has {size} bytes, the manifest says {expect['bytes']}")
    buf = aligned_empty(min(_CHUNK, block))
    for i, want in enumerate(crcs):
        start, stop = i * block, min((i + 1) * block, size)
        crc, pos = 0, start
        while pos < stop:
            view = buf[:min(len(buf), stop - pos)]
            if read_into(path, pos, view) != len(view):
                raise CheckpointCorruptError(f"{path}: file shrank while reading at byte {pos}")
            crc = zlib.crc32(view.numpy().data, crc)
            pos += len(view)
        if crc != want:
            raise CheckpointCorruptError(f"{path}: checksum mismatch in bytes [{start}, {stop}): the file "
                                         "is damaged; restore it or load an earlier step")
