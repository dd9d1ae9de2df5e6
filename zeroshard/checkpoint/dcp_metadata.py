"""Reading a torch Distributed Checkpoint (DCP) directory as untrusted input.

DCP's ``.metadata`` is a raw pickle (torch's own reader calls ``pickle.load`` on it), so it is
read here by ``_MetadataUnpickler``, which admits only the classes DCP's metadata is made of
and refuses anything else before it is called (Note [DCP metadata unpickling]). The data files
hold per-chunk blobs (``torch.save`` of a tensor, or of a small object for bytes entries),
read with ``torch.load(weights_only=True)``. Paths named by the metadata are checked to stay in
the directory, and every blob's byte range is checked against its file's real size.
"""
from __future__ import annotations

import functools
import io
import os
import pickle
import posixpath
import zlib
from typing import TYPE_CHECKING, Optional, Protocol

import torch

from zeroshard.checkpoint import safe_fs
from zeroshard.checkpoint.checkpoint_errors import CheckpointCorruptError

if TYPE_CHECKING:  # (torch.distributed.checkpoint is imported when a DCP checkpoint is read: 0.7 s of CPU
    # that a process which never meets one should not pay; Note [pipelining imported on first use])
    from torch.distributed.checkpoint import metadata as md
    from torch.distributed.checkpoint.filesystem import _StorageInfo

METADATA = ".metadata"
CHECKSUMS = "zeroshard-dcp.json"
"""Beside ``.metadata`` in a DCP checkpoint zeroshard wrote: every file's size and CRC32."""


class Stateful(Protocol):
    """A scheduler or data loader: what a checkpoint restores."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state_dict: dict) -> None: ...

MAX_METADATA_BYTES = 1 << 30
"""A ``.metadata`` describes chunks (about 200 bytes each); a gigabyte is millions of them."""

# Note [DCP metadata unpickling]: the classes a ``.metadata`` pickle names, found by reading
# the opcodes of files written by ``dcp.save`` (torch 2.13): DCP's own dataclasses, which
# hold only data (their ``__setstate__``, TensorProperties', only decodes an enum), plus
# ``torch.Size``, dtypes, layouts (through ``torch.serialization._get_layout``, which looks a
# name up in a table) and ``pathlib.PosixPath`` (``storage_meta.checkpoint_id``, read as a
# PurePosixPath: no filesystem access). ``find_class`` returns only these; any other global
# (``os.system``, ``builtins.eval``, a class whose constructor does I/O) raises before the
# pickle can call it. torch's ``weights_only`` loader is not used: it reads zip archives of
# ``torch.save``, not a bare pickle stream, and its allow-list would need DCP's classes added
# process-wide (``add_safe_globals``), which changes what every other ``torch.load`` admits.
@functools.cache
def _allowed() -> dict[tuple[str, str], object]:
    from torch.distributed.checkpoint import metadata as md
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    allowed: dict[tuple[str, str], object] = {
        ("torch.distributed.checkpoint.metadata", n): getattr(md, n)
        for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                  "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
    }
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("pathlib", "PosixPath")] = __import__("pathlib").PurePosixPath
    allowed[("pathlib", "PurePosixPath")] = __import__("pathlib").PurePosixPath
    return allowed


def _layout(name: object) -> torch.layout:
    table = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
    if not isinstance(name, str) or name not in table:
        raise pickle.UnpicklingError(f"layout {name!r} is not a torch layout")
    return table[name]


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> object:
        allowed = _allowed()
        if (module, name) in allowed:
            return allowed[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) == ("torch.serialization", "_get_layout"):
            return _layout
        raise pickle.UnpicklingError(
            f"global {module}.{name} is not one of DCP's metadata classes; refusing to call it (a pickle "
            "that names other callables could run any code)")


def is_dcp_dir(path: str) -> bool:
    """A directory holding a DCP ``.metadata`` (not followed through a link)."""
    return safe_fs.is_real_dir(path) and os.path.lexists(os.path.join(path, METADATA))


def read_metadata(directory: str) -> md.Metadata:
    """The checked ``Metadata`` of DCP checkpoint ``directory``; CheckpointCorruptError naming the
    file for anything that is not DCP metadata (including a pickle that would run code)."""
    path = os.path.join(directory, METADATA)
    raw = safe_fs.read_small(path, MAX_METADATA_BYTES)
    try:
        meta = _MetadataUnpickler(io.BytesIO(raw)).load()
    except pickle.UnpicklingError as exc:
        raise CheckpointCorruptError(f"{path}: refused ({exc})") from None
    except Exception as exc:  # noqa: BLE001 - a malformed pickle raises anything; none is trusted
        raise CheckpointCorruptError(f"{path} is not a DCP metadata file ({type(exc).__name__}: {exc})") from None
    _check(meta, path)
    return meta


def _check(meta: object, path: str) -> None:
    """Every field the reader uses has the type DCP writes (a pickle sets any attribute)."""
    from torch.distributed.checkpoint import metadata as md
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    def bad(what: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{path}: malformed DCP metadata ({what})")
    if not isinstance(meta, md.Metadata) or not isinstance(meta.state_dict_metadata, dict):
        raise bad(f"a {type(meta).__name__}, not Metadata with a state_dict_metadata dict")
    for key, entry in meta.state_dict_metadata.items():
        if not isinstance(key, str):
            raise bad(f"key {key!r} is not a str")
        if isinstance(entry, md.BytesStorageMetadata):
            continue
        if not isinstance(entry, md.TensorStorageMetadata) or not isinstance(entry.size, torch.Size) or \
                not isinstance(getattr(entry.properties, "dtype", None), torch.dtype) or \
                not isinstance(entry.chunks, list):
            raise bad(f"{key}: not a tensor or bytes entry")
        for c in entry.chunks:
            if not isinstance(c, md.ChunkStorageMetadata) or not _ints(c.offsets, len(entry.size)) or \
                    not _ints(c.sizes, len(entry.size)) or \
                    any(o + s > g for o, s, g in zip(c.offsets, c.sizes, entry.size)):
                raise bad(f"{key}: chunk {c!r} outside the tensor's size {list(entry.size)}")
    storage = meta.storage_data
    if not isinstance(storage, dict):
        raise bad("storage_data is not a dict")
    for index, info in storage.items():
        if not isinstance(index, md.MetadataIndex) or not isinstance(info, _StorageInfo) or \
                not isinstance(info.relative_path, str) or not _ints((info.offset, info.length), 2):
            raise bad(f"storage entry {index!r}: {info!r}")
        inside(info.relative_path, path)


def _ints(values: object, n: int) -> bool:
    return isinstance(values, (tuple, list)) and len(values) == n and \
        all(type(v) is int and 0 <= v < 1 << 62 for v in values)


def inside(relative: str, where: str) -> str:
    """``relative`` if it names a file in the checkpoint directory itself (no absolute path, no
    ``..``, no subdirectory: DCP writes ``__{rank}_{i}.distcp`` beside ``.metadata``)."""
    if not relative or posixpath.isabs(relative) or os.path.isabs(relative) or "/" in relative or \
            "\\" in relative or relative in (".", "..") or "\x00" in relative:
        raise CheckpointCorruptError(f"{where}: data file path {relative!r} leaves the checkpoint directory; "
                                     "DCP data files are plain names beside .metadata")
    return relative


def read_range(directory: str, info: _StorageInfo, what: str) -> bytes:
    """The bytes of one blob, checked against its file's size (a truncated file says so)."""
    if info.transform_descriptors:
        raise CheckpointCorruptError(f"{what}: stored with DCP extensions {list(info.transform_descriptors)} "
                                     "(e.g. compression), which zeroshard does not read; save without them")
    path = os.path.join(directory, inside(info.relative_path, os.path.join(directory, METADATA)))
    fd, _ = safe_fs.open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if info.offset + info.length > size:
            raise CheckpointCorruptError(f"{path} is truncated: {what} needs bytes [{info.offset}, "
                                         f"{info.offset + info.length}) of a {size}-byte file")
        data = os.pread(fd, info.length, info.offset)
    finally:
        os.close(fd)
    if len(data) != info.length:
        raise CheckpointCorruptError(f"{path}: short read of {what} ({len(data)} of {info.length} bytes)")
    return data


def load_blob(data: bytes, what: str) -> object:
    """A ``torch.save`` blob, loaded with ``weights_only`` (tensors and plain values only)."""
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - damaged or hostile bytes raise anything
        raise CheckpointCorruptError(f"{what} is not a readable tensor or value blob ({type(exc).__name__}: "
                                     f"{str(exc)[:300]})") from None


def crc32_of(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            crc = zlib.crc32(block, crc)
    return crc


def verify(step_dir: str, full: bool = False) -> Optional[str]:
    """Why a DCP step directory zeroshard wrote is not whole, or None: every file's size, and
    the CRC32 of ``.metadata`` (``full``: of every file, which reads them all) against its
    checksum file. A DCP directory without the file (FSDP2's own) is not checked. (A load
    reads only its chunks: a truncated file is caught here, a damaged chunk by its blob.)"""
    path = os.path.join(step_dir, CHECKSUMS)
    if not os.path.lexists(path):
        return None
    try:
        record = safe_fs.parse_json(safe_fs.read_small(path, 1 << 24), path)
        for name, want in record["files"].items():
            found = os.path.join(step_dir, inside(name, path))
            if safe_fs.regular_size(found) != want["size"] or \
                    (full or name == METADATA) and crc32_of(found) != want["crc32"]:
                return f"{found} does not match its size or checksum in {CHECKSUMS}"
    except (CheckpointCorruptError, KeyError, TypeError, AttributeError) as exc:
        return f"{path}: {exc}"
    return None
