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
from typing import Optional

from zeroshard.checkpoint.errors import CheckpointCorruptError
from zeroshard.checkpoint.safe_fs import parse_json, read_small
from zeroshard.checkpoint.validate import FORMAT, VERSION, check_files, check_header, check_step_name, check_tensors

MANIFEST = "manifest.json"
LATEST = "latest"
STEP_RE = re.compile(r"step-([0-9]{8,})", re.ASCII)
"""A committed step's directory name, matched with ``fullmatch`` (ASCII digits only, nothing
after them: ``step-0000٩`` and ``step-00000009\\n`` are not steps)."""
FILE_RE = re.compile(r"(rank|rng)-[0-9]{5}\.(safetensors|json)", re.ASCII)
MAX_MANIFEST = 256 << 20
"""Bytes a manifest may have (read whole, so this bounds the memory a hostile one costs): about
200 bytes per piece, so a million pieces fit."""


def step_of(name: str) -> Optional[int]:
    """The step a directory name stands for, or None: only the canonical spelling counts."""
    m = STEP_RE.fullmatch(name)
    return int(m.group(1)) if m and name == step_dir_name(int(m.group(1))) else None


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
    """Parses and validates ``step_dir/manifest.json`` (every field, see ``validate``) and
    checks that the directory is named for its step; raises CheckpointCorruptError."""
    path = os.path.join(step_dir, MANIFEST)
    outer = parse_json(read_small(path, MAX_MANIFEST), path)
    if not isinstance(outer, dict) or not isinstance(outer.get("manifest"), dict):
        raise CheckpointCorruptError(f"{path} has no 'manifest' object; not a zeroshard checkpoint")
    body = outer["manifest"]
    try:
        canonical = _canonical(body)
    except (ValueError, RecursionError):  # circular or too deep to re-encode
        raise CheckpointCorruptError(f"{path}: the manifest cannot be re-encoded to check it") from None
    if outer.get("crc32") != zlib.crc32(canonical):
        raise CheckpointCorruptError(f"{path}: checksum mismatch; the manifest was damaged or edited "
                                     "(CRC32 detects accidental damage, not deliberate edits)")
    validate(body, path)
    check_step_name(os.path.basename(os.path.normpath(step_dir)), body["step"], path)
    return body


def validate(body: dict, path: str) -> None:
    """Every field, before anything is trusted (``zeroshard.checkpoint.validate``)."""
    check_header(body, path)
    check_files(body, path)
    check_tensors(body, path)
