"""Two slots of one rank's state in the memory tier (its own, or a replica it keeps for a peer).

A slot directory holds ``data.bin`` (the tensors' bytes), ``header.json`` (where each piece
lies in it, the small state) and ``stamp.json`` (run id, model digest, step, world size, owner
rank, sizes, crc32 of the header, the checksum of the data and its algorithm: Note [slot checksum]). A write removes the slot's stamp first and writes it
last (to a temporary name, then renamed): a slot without a stamp, or whose bytes do not match
it, is not valid, and the other slot still holds the previous step (Note [peer memory tier]).
"""
from __future__ import annotations

import errno
import json
import mmap
import os
import stat
import zlib
from dataclasses import dataclass
from typing import Optional

import torch

from zeroshard.resilience import checksum

FORMAT, VERSION = "zeroshard-memory-tier", 1
SLOTS = ("slot-0", "slot-1")
_STAMP, _HEADER, _DATA = "stamp.json", "header.json", "data.bin"
_MAX_JSON = 1 << 28


@dataclass(frozen=True)
class SlotInfo:
    """One slot found on this node: its directory, its stamp, and why it cannot be used (None: valid)."""

    path: str
    stamp: dict
    problem: Optional[str]

    @property
    def step(self) -> int:
        return int(self.stamp.get("step", -1))


def _read_regular(path: str, limit: int) -> bytes:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise ValueError(f"{path}: {size} bytes, more than the {limit} a slot file may have")
        chunks, left = [], size
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 26))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_stamp(slot: str) -> Optional[dict]:
    try:
        stamp = json.loads(_read_regular(os.path.join(slot, _STAMP), 1 << 16))
    except (OSError, ValueError):
        return None
    return stamp if isinstance(stamp, dict) and stamp.get("format") == FORMAT else None


def check(slot: str, stamp: dict, run_id: str, digest: str) -> Optional[str]:
    """Why the slot cannot be loaded into this run (None: it matches; its bytes are checked on read)."""
    if stamp.get("version") != VERSION:
        return f"format version {stamp.get('version')!r}, not {VERSION}"
    if stamp.get("run_id") != run_id:
        return f"written by run {stamp.get('run_id')!r}, not this run {run_id!r}"
    if stamp.get("digest") != digest:
        return f"written for another model (digest {str(stamp.get('digest'))[:12]}, this model's {digest[:12]})"
    if not all(isinstance(stamp.get(k), int) and not isinstance(stamp.get(k), bool) and stamp[k] >= 0
               for k in ("step", "world_size", "owner", "header_bytes", "data_bytes", "crc32", "data_crc32")):
        return "malformed stamp"
    return None


def scan(directory: str, run_id: str, digest: str) -> list[SlotInfo]:
    """Every stamped slot under ``directory`` (one slot pair), valid or not (the reason said)."""
    out = []
    for name in SLOTS:
        slot = os.path.join(directory, name)
        stamp = read_stamp(slot)
        if stamp is not None:
            out.append(SlotInfo(slot, stamp, check(slot, stamp, run_id, digest)))
    return out


def _read_into(path: str, size: int) -> torch.Tensor:
    """The file's bytes in one uint8 tensor, read straight into it (no intermediate copy)."""
    out = torch.empty(size, dtype=torch.uint8)
    view = out.numpy().data.cast("B") if size else memoryview(b"")
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        if os.fstat(fd).st_size != size:
            raise ValueError(f"{path}: torn slot ({os.fstat(fd).st_size} bytes, stamped {size})")
        done = 0
        while done < size:
            n = os.readv(fd, [view[done:]])
            if n <= 0:
                raise ValueError(f"{path}: torn slot (ends at byte {done} of {size})")
            done += n
    finally:
        os.close(fd)
    return out


def read(info: SlotInfo) -> tuple[dict, torch.Tensor]:
    """The slot's header and data (a uint8 tensor), verified against its stamp; ValueError if torn."""
    stamp = info.stamp
    raw = _read_regular(os.path.join(info.path, _HEADER), _MAX_JSON)
    algorithm = stamp.get("checksum", checksum.CRC32)
    if algorithm == checksum.CRC32C and stamp["data_bytes"] and checksum.native() is not None:
        data = torch.empty(stamp["data_bytes"], dtype=torch.uint8)  # read and checked in one pass
        crc = copy_data(info.path, data, algorithm)
    else:
        data = _read_into(os.path.join(info.path, _DATA), stamp["data_bytes"])
        crc = checksum.of(algorithm, data)
    if len(raw) != stamp["header_bytes"]:
        raise ValueError(f"{info.path}: torn slot (header of {len(raw)} bytes, stamped {stamp['header_bytes']})")
    if zlib.crc32(raw) != stamp["crc32"] or crc != stamp["data_crc32"]:
        raise ValueError(f"{info.path}: torn slot (checksum mismatch)")
    header = json.loads(raw)
    if not isinstance(header, dict):
        raise ValueError(f"{info.path}: malformed header")
    return header, data


def _write_file(path: str, *parts: bytes | memoryview) -> None:
    with open(path, "wb") as f:
        for p in parts:
            f.write(p)


def begin(directory: str) -> str:
    """Picks the slot of ``directory`` that does not hold the newest valid step (the older, or
    an empty one) and removes its stamp: invalid from here until ``finish`` stamps it."""
    os.makedirs(directory, exist_ok=True)
    held = {name: read_stamp(os.path.join(directory, name)) for name in SLOTS}
    steps = {name: (s["step"] if s is not None and isinstance(s.get("step"), int) else -1) for name, s in held.items()}
    slot = os.path.join(directory, min(SLOTS, key=lambda n: (steps[n], n)))
    os.makedirs(slot, exist_ok=True)
    try:
        os.unlink(os.path.join(slot, _STAMP))
    except FileNotFoundError:
        pass
    return slot


class Mapped:
    """A slot's ``data.bin`` of a fixed size, its space reserved (fallocate: a full tmpfs says
    ENOSPC here, where a store through the mapping would SIGBUS) and mapped for the life of the
    tier, so a commit copies the state straight into it (Note [peer memory tier])."""

    def __init__(self, slot: str, size: int) -> None:
        self.path, self.size = os.path.join(slot, _DATA), size
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.ENOTSUP, f"{self.path} is not a regular file")
            if st.st_size != size:
                os.ftruncate(fd, 0)  # (another size: the old pages are given back first)
            os.posix_fallocate(fd, 0, size)
            os.ftruncate(fd, size)
            self.ino = os.fstat(fd).st_ino
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)

    def current(self, size: int) -> bool:
        """Whether this mapping is still the slot's file at ``size`` bytes."""
        try:
            return size == self.size and os.stat(self.path, follow_symlinks=False).st_ino == self.ino
        except OSError:
            return False


def copy_data(slot: str, into: torch.Tensor, algorithm: str) -> int:
    """Copies the data of ``slot`` (of exactly ``into``'s size) into ``into`` and returns its
    ``algorithm`` checksum, computed in the same pass where the kernel loads (a replica by file,
    Note [replica by file] in zeroshard/resilience/memory_tier.py)."""
    fd = os.open(os.path.join(slot, _DATA), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != into.numel():
            raise ValueError(f"{slot}: torn slot ({st.st_size} bytes of data, stamped {into.numel()})")
        # (a private mapping: nothing is written through it, and torch needs a writable buffer)
        mapped = mmap.mmap(fd, into.numel(), access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    try:
        return checksum.copy_in(algorithm, into, [(0, torch.frombuffer(mapped, dtype=torch.uint8))])
    finally:
        try:
            mapped.close()
        except BufferError:
            pass  # (a view still alive: the mapping goes with it)


def write_data(slot: str, data: memoryview) -> None:
    """The data of a slot that cannot be mapped (not a regular file), by ``write``."""
    _write_file(os.path.join(slot, _DATA), data.cast("B"))


def finish(slot: str, stamp: dict, raw: bytes, data_bytes: int, data_crc: int) -> None:
    """Stamps a slot whose data is written (``raw``: the header's JSON; ``data_crc``: crc32 of the
    data, computed once by the owner and sent with a replica): the header, then the stamp last."""
    _write_file(os.path.join(slot, _HEADER), raw)
    full = {**stamp, "format": FORMAT, "version": VERSION, "header_bytes": len(raw), "data_bytes": data_bytes,
            "crc32": zlib.crc32(raw), "data_crc32": data_crc}
    tmp = os.path.join(slot, _STAMP + ".tmp")
    _write_file(tmp, json.dumps(full).encode())
    os.replace(tmp, os.path.join(slot, _STAMP))


def slot_bytes(directory: str) -> int:
    """Bytes the slots under ``directory`` take (for reports)."""
    total = 0
    for root, _, files in os.walk(directory):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def data_bytes(directory: str) -> int:
    """Bytes of the slots' data under ``directory`` (both slots; headers and stamps not counted):
    what ``MemoryTier.report`` compares between the own slots and the parity slots."""
    total = 0
    for name in SLOTS:
        try:
            total += os.lstat(os.path.join(directory, name, _DATA)).st_size
        except OSError:
            pass
    return total
