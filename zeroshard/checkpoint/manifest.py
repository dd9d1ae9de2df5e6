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
import zlib

from zeroshard.checkpoint.checkpoint_errors import CheckpointCorruptError
from zeroshard.checkpoint.names import FILE_RE, STEP_RE, data_file, rng_file, step_dir_name, step_of  # noqa: F401
from zeroshard.checkpoint.safe_fs import parse_json, read_small
from zeroshard.checkpoint.validate import FORMAT, VERSION, check_files, check_header, check_step_name, check_tensors  # noqa: F401

MANIFEST = "manifest.json"
LATEST = "latest"
MAX_MANIFEST = 256 << 20
"""Bytes a manifest may have (read whole, so this bounds the memory a hostile one costs): about
200 bytes per piece, so a million pieces fit."""


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
