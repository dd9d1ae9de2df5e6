"""The manifest: a checkpoint's table of contents, and the only thing a loader trusts after
checking it. Layout on disk (see DESIGN.md, "Checkpoint layout")::

    root/step-00001200/manifest.json   {"manifest": {...}, "crc32": <crc of its canonical JSON>}
    root/step-00001200/rank-00000.safetensors ...  rng-00000.json ...
    root/latest                        "step-00001200"

Nothing in a manifest is used as a path: file names must match ``FILE_RE`` and are joined to
the step directory by the loader; numbers are range-checked before anything is allocated.
"""
from __future__ import annotations

import json
import os
import re
import zlib
from typing import Any

from zeroshard.checkpoint.errors import CheckpointCorruptError
from zeroshard.checkpoint.shard_file import DTYPES

FORMAT = "zeroshard.checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
LATEST = "latest"
STEP_RE = re.compile(r"^step-(\d{8,})$")
FILE_RE = re.compile(r"^(rank|rng)-\d{5}\.(safetensors|json)$")
_MAX_NUMEL = 1 << 42  # 4 T elements: far beyond any real tensor, far below an overflow
_MAX_BYTES = 1 << 50


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def data_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def rng_file(rank: int) -> str:
    return f"rng-{rank:05d}.json"


def _canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()


def write(path: str, body: dict) -> None:
    raw = json.dumps({"manifest": body, "crc32": zlib.crc32(_canonical(body))}, indent=1,
                     allow_nan=True).encode()
    with open(path, "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())


def read(step_dir: str) -> dict:
    """Parses and validates ``step_dir/manifest.json``; raises CheckpointCorruptError."""
    path = os.path.join(step_dir, MANIFEST)
    try:
        if os.path.getsize(path) > 1 << 30:
            raise CheckpointCorruptError(f"{path} is larger than 1 GiB; not a zeroshard manifest")
        with open(path, "rb") as f:
            outer = json.loads(f.read())
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{path} is missing: {step_dir} is not a committed checkpoint") from None
    except ValueError as exc:
        raise CheckpointCorruptError(f"{path} is not valid JSON ({exc}): the manifest is damaged") from None
    if not isinstance(outer, dict) or not isinstance(outer.get("manifest"), dict):
        raise CheckpointCorruptError(f"{path} has no 'manifest' object; not a zeroshard checkpoint")
    body = outer["manifest"]
    if outer.get("crc32") != zlib.crc32(_canonical(body)):
        raise CheckpointCorruptError(f"{path}: checksum mismatch; the manifest was damaged or edited")
    validate(body, path)
    return body


def _fail(path: str, what: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(f"{path}: {what}; refusing to load this checkpoint")


def _int(v: Any, lo: int, hi: int, path: str, what: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise _fail(path, f"{what}={v!r} is outside [{lo}, {hi}]")
    return v


def validate(body: dict, path: str) -> None:
    """Structure, names and sizes; pieces of every sharded tensor must tile it exactly."""
    if body.get("format") != FORMAT:
        raise _fail(path, f"format {body.get('format')!r} is not {FORMAT!r}")
    if body.get("version") != VERSION:
        raise _fail(path, f"format version {body.get('version')!r}; this zeroshard reads version "
                          f"{VERSION} (upgrade zeroshard to read newer checkpoints)")
    _int(body.get("step"), 0, 1 << 62, path, "step")
    world = _int(body.get("world_size"), 1, 1 << 20, path, "world_size")
    _int(body.get("stage"), 0, 3, path, "stage")
    files = body.get("files")
    if not isinstance(files, dict):
        raise _fail(path, "'files' is not an object")
    for name, meta in files.items():
        if not isinstance(name, str) or not FILE_RE.match(name):
            raise _fail(path, f"file name {name!r} is not a checkpoint file name (rank-NNNNN.safetensors "
                              "or rng-NNNNN.json); paths in a manifest are never followed")
        size = _int(meta.get("bytes") if isinstance(meta, dict) else None, 0, _MAX_BYTES, path, f"{name} bytes")
        block = _int(meta.get("block_size"), 1, 1 << 34, path, f"{name} block_size")
        crcs = meta.get("crc32")
        if not isinstance(crcs, list) or len(crcs) != max(1, -(-size // block)) and size:
            raise _fail(path, f"{name}: {len(crcs) if isinstance(crcs, list) else crcs!r} checksums for "
                              f"{size} bytes in blocks of {block}")
    for r in range(world):
        if rng_file(r) not in files:
            raise _fail(path, f"{rng_file(r)} is not listed; the checkpoint is incomplete")
    tensors = body.get("tensors")
    if not isinstance(tensors, dict):
        raise _fail(path, "'tensors' is not an object")
    for name, meta in tensors.items():
        _validate_tensor(name, meta, files, path)


def _validate_tensor(name: str, meta: Any, files: dict, path: str) -> None:
    if not isinstance(meta, dict) or meta.get("dtype") not in DTYPES or not isinstance(meta.get("shape"), list):
        raise _fail(path, f"tensor {name!r} has a malformed entry")
    numel = 1
    for d in meta["shape"]:
        numel *= _int(d, 0, _MAX_NUMEL, path, f"{name} dimension")
    _int(numel, 0, _MAX_NUMEL, path, f"{name} numel")
    covered = 0
    for p in meta.get("pieces", []):
        if not isinstance(p, dict) or p.get("file") not in files or not isinstance(p.get("keys"), dict):
            raise _fail(path, f"tensor {name!r}: a piece names file {p.get('file') if isinstance(p, dict) else p!r}, "
                              "which the manifest does not list")
        start = _int(p.get("start"), 0, numel, path, f"{name} piece start")
        stop = _int(p.get("stop"), start, numel, path, f"{name} piece stop")
        if start != covered:
            raise _fail(path, f"tensor {name!r}: pieces leave a gap or overlap at element {covered} "
                              f"(next piece starts at {start})")
        covered = stop
    if covered != numel:
        raise _fail(path, f"tensor {name!r}: pieces cover {covered} of {numel} elements")
