"""``BlockActivations``: one covered block call's saved tensors, from its forward to its backward.

Lifecycle (``state``): HELD while the block's forward runs (autograd's saved tensors are
collected, still on the device) -> OUT once the forward ended (copied into one host buffer;
under "nvme" written to one file with a checksum and the host buffer let go) -> LOADING
(prefetched: a read in flight, or a host-to-device copy on the copy stream) -> LOADED
(the buffer is back, handed to autograd entry by entry) -> DONE (every entry was unpacked
once: the loaded buffer goes; the file stays until the graph drops the record, for a backward
with ``retain_graph``). A write or read that fails turns it FAILED, naming the block.

Note [activation file checksum]: a block's file is checked when it is read back (a damaged or
truncated file is an error naming the block, never wrong gradients). The checksum was zlib's crc32,
a second pass over the buffer after the copy out and again after the read: with the copies, most
of the offload's own CPU cost per step (docs/results.md, "Step time ÷ its floor"). It is now the
memory tier's CRC-32C (zeroshard/resilience/checksum.py, Note [slot checksum]): computed while the
saved tensors are copied into the staging buffer (one pass) and at ~8 GB/s on the read, with zlib's
crc32 where the kernel is not built (``checksum.preferred``; each record keeps its algorithm).
"""
from __future__ import annotations

import enum
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Optional

import torch

from zeroshard.io.aio_engine import AsyncIO
from zeroshard.io.buffers import ALIGN
from zeroshard.io.handle import Handle
from zeroshard.io.host_pool import HOST_POOL
from zeroshard.resilience import checksum


class RecordState(enum.Enum):
    HELD = "held"
    OUT = "out"
    LOADING = "loading"
    LOADED = "loaded"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class Entry:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int
    version: int


def dense_span(t: torch.Tensor) -> bool:
    """``t`` covers its memory exactly (contiguous, or a permutation of a contiguous tensor): a
    copy of its bytes keeps its strides, so backward computes on the same layout (same bits)."""
    if t.numel() == 0 or any(s < 0 for s in t.stride()):
        return False
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())) == t.numel()


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _raw(t: torch.Tensor) -> torch.Tensor:
    """``t``'s memory as a flat contiguous tensor (a held tensor covers its memory exactly, ``dense_span``,
    its first element lowest): its bytes copied as they are keep its strides at the record's offset."""
    return t if t.is_contiguous() else t.as_strided((t.numel(),), (1,))


def _key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


class BlockActivations:
    def __init__(self, block: str, call: int, device: torch.device, copy_stream: Optional[torch.cuda.Stream] = None,
                 algorithm: Optional[str] = None) -> None:
        self.block = block
        self.call = call
        self.device = device
        self.state = RecordState.HELD
        self.entries: list[Entry] = []
        self.nbytes = 0
        """Bytes of the host buffer (entries at ALIGN-aligned offsets)."""
        self.moved = 0
        """Bytes of the entries themselves (what left the device)."""
        self._held: list[torch.Tensor] = []
        self._index: dict[tuple, int] = {}
        self._host: Optional[torch.Tensor] = None
        self._loaded_dev: Optional[list[torch.Tensor]] = None
        self._event: Optional[torch.cuda.Event] = None
        self._stream = copy_stream
        self.path: Optional[str] = None
        self._crc = 0
        self._algorithm = algorithm or checksum.preferred()
        """The file's checksum (Note [activation file checksum]); "crc32" is the earlier one (benchmarks compare)."""
        self._write: Optional[Handle] = None
        self._staging: Optional[torch.Tensor] = None
        self._read: Optional[Handle] = None
        self._read_error: Optional[BaseException] = None
        self._unpacked: set[int] = set()
        self._lock = threading.Lock()
        self.neighbours: list[weakref.ref] = []
        """The forward pass's records in order (this one among them): whom to prefetch after this one."""
        self.position = 0

    def __repr__(self) -> str:
        return f"BlockActivations({self.block!r}, call={self.call}, state={self.state.value}, bytes={self.moved})"

    # -- forward ---------------------------------------------------------------------------------
    def add(self, t: torch.Tensor) -> int:
        """Holds ``t`` (a saved tensor of this block) until the forward ends; its entry index.
        The same tensor saved by several ops is kept once (the record holds it, so its memory
        cannot be reused by another tensor while the key is in use)."""
        key = _key(t)
        found = self._index.get(key)
        if found is not None:
            return found
        nbytes = t.numel() * t.element_size()
        self.entries.append(Entry(tuple(t.shape), t.stride(), t.dtype, self.nbytes, nbytes, t._version))
        self._held.append(t)
        self._index[key] = len(self.entries) - 1
        self.nbytes += -(-nbytes // ALIGN) * ALIGN
        self.moved += nbytes
        return len(self.entries) - 1

    def _view(self, buf: torch.Tensor, i: int) -> torch.Tensor:
        e = self.entries[i]
        return buf[e.offset:e.offset + e.nbytes].view(e.dtype).as_strided(e.shape, e.stride)

    def _buffer(self) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
        return HOST_POOL.empty(self.nbytes, torch.uint8)

    def move_out(self, io: Optional[AsyncIO], directory: Optional[str]) -> None:
        """The forward ended: the held tensors go to one host buffer (and under "nvme" to a
        file written in the background), and the device lets go of them."""
        for e, t in zip(self.entries, self._held):
            if t._version != e.version:  # (autograd would refuse it at backward; the copy must not hide it)
                raise RuntimeError(
                    f"activation offload: a tensor block {self.block!r} saved for backward (shape {e.shape}) was "
                    "modified in place later in its forward; autograd's backward would be wrong. Make the "
                    "in-place operation out of place, or leave this block out (ActivationOffload(blocks=...))")
        buf = self._buffer()
        if self.device.type == "cuda":  # (Note [activation copies on a GPU] in offloader.py)
            stream = self._stream
            assert stream is not None
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for i, t in enumerate(self._held):
                    self._view(buf, i).copy_(t, non_blocking=True)
                    t.record_stream(stream)
                self._event = torch.cuda.Event()
                self._event.record(stream)
        elif io is not None:  # (the checksum in the copy's pass: Note [activation file checksum])
            self._crc = checksum.copy_in(self._algorithm, buf, [(e.offset, _raw(t)) for e, t in zip(self.entries,
                                                                                                 self._held)])
        else:
            for i, t in enumerate(self._held):
                self._view(buf, i).copy_(t)
        self._held = []
        self._index = {}
        if io is None:
            self._host = buf
        else:
            if self._event is not None:
                self._event.synchronize()
                self._crc = checksum.of(self._algorithm, buf)
            assert directory is not None
            self.path = os.path.join(directory, f"act-{self.call:08d}.bin")
            weakref.finalize(self, _remove, self.path)  # (the graph dropped the record: its file goes)
            self._staging = buf
            try:
                self._write = io.pwrite(buf, self.path)
            except OSError as exc:
                self.state = RecordState.FAILED
                self._staging = None
                self.discard()
                raise self._write_error(exc) from exc
        self.state = RecordState.OUT

    def _write_error(self, exc: BaseException) -> RuntimeError:
        return RuntimeError(
            f"activation offload: writing block {self.block!r}'s saved activations ({self.moved} bytes) to "
            f"{self.path} failed: {exc}. This forward was abandoned and its activation files removed; free space "
            "in the NVMe directory (or offload_activations='cpu'), then run the step again")

    def written(self, wait: bool) -> bool:
        """The file is complete (True), still being written (False: only with ``wait=False``), or
        a RuntimeError naming the block (the file is removed: nothing half-written stays)."""
        h = self._write
        if h is None:
            return True
        if not wait and not h.done():
            return False
        try:
            h.wait()
        except OSError as exc:
            self._write = None
            self.state = RecordState.FAILED
            self.discard()
            raise self._write_error(exc) from exc
        self._write = None
        staging, self._staging = self._staging, None
        if staging is not None and self.device.type != "cuda":
            HOST_POOL.release(staging)  # (ours alone: no view of it was handed out)
        return True

    # -- backward --------------------------------------------------------------------------------
    def prefetch(self, io: Optional[AsyncIO]) -> None:
        """Starts bringing this record back (a read, or a copy to the device); never blocks, never
        raises (an error is raised by ``tensor`` at the block's backward)."""
        with self._lock:
            self._start(io)

    def _start(self, io: Optional[AsyncIO]) -> None:
        if self.state is not RecordState.OUT:
            return
        self.state = RecordState.LOADING
        if io is not None:
            assert self.path is not None
            try:
                self.written(wait=True)
                buf = self._buffer()
                self._read = io.pread(buf, self.path)
                self._host = buf
            except (OSError, RuntimeError) as exc:
                self._read_error = exc
            return
        if self.device.type == "cuda":
            self._to_device()

    def _to_device(self) -> None:
        """The copy back runs on the copy stream, after the copy out (same stream); the compute
        stream waits for its event before using it (Note [activation copies on a GPU] in offloader.py)."""
        assert self._host is not None
        stream = self._stream
        assert stream is not None
        with torch.cuda.stream(stream):
            self._loaded_dev = [self._view(self._host, i).to(self.device, non_blocking=True)
                                for i in range(len(self.entries))]
            self._event = torch.cuda.Event()
            self._event.record(stream)

    def _load(self, io: Optional[AsyncIO]) -> None:
        self._start(io)
        if self.state is not RecordState.LOADING:
            return
        if self._read_error is not None or self._read is not None:
            try:
                if self._read_error is not None:
                    raise self._read_error
                assert self._read is not None and self._host is not None
                self._read.wait()
                if checksum.of(self._algorithm, self._host) != self._crc:
                    raise RuntimeError(f"its checksum does not match what was written ({self.nbytes} bytes)")
            except (OSError, RuntimeError) as exc:
                self.state = RecordState.FAILED
                self._host = None
                raise RuntimeError(
                    f"activation offload: block {self.block!r}'s saved activations could not be read back from "
                    f"{self.path}: {exc}. The file was damaged or removed during the step; this backward is "
                    "abandoned (the weights and optimizer state are as before it: zero_grad() and run the step "
                    "again)") from exc
            self._read = None
            if self.device.type == "cuda":
                self._to_device()
        self.state = RecordState.LOADED

    def tensor(self, i: int, io: Optional[AsyncIO]) -> torch.Tensor:
        """Entry ``i`` back where it was saved, for autograd (waits for its prefetch)."""
        with self._lock:
            if self.state is RecordState.FAILED:
                raise RuntimeError(f"activation offload: block {self.block!r}'s saved activations were lost in an "
                                   "earlier error of this step; zero_grad() and run the step again")
            if self.state is RecordState.DONE:  # (a second backward through a retained graph)
                self.state = RecordState.OUT
                self._unpacked.clear()
            self._load(io)
            if self.device.type == "cuda":
                assert self._loaded_dev is not None and self._event is not None
                current = torch.cuda.current_stream(self.device)
                current.wait_event(self._event)
                out = self._loaded_dev[i]
                out.record_stream(current)
            else:
                assert self._host is not None
                out = self._view(self._host, i)
            self._unpacked.add(i)
            if len(self._unpacked) == len(self.entries):
                self.state = RecordState.DONE
                self._loaded_dev = None
                if io is not None:  # (the file stays for a retained graph; the host copy goes)
                    self._host = None
            return out

    def abandon(self) -> None:
        """The backward using this record failed: it is let go of, and says so if asked again."""
        with self._lock:
            self.state = RecordState.FAILED
            self.discard()

    def discard(self) -> None:
        """Lets go of everything this record holds; removes its file (the graph is gone, or the
        forward that made it was abandoned)."""
        self._held, self._host, self._loaded_dev, self._staging = [], None, None, None
        if self._write is not None:
            try:
                self._write.wait()
            except OSError:
                pass
            self._write = None
        if self.path is not None:
            _remove(self.path)
