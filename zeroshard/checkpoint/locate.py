"""Finding a loadable step: ``latest``, then the newest step that passes its checks.

The checks are the loader's own: ``load_checkpoint(root)`` runs ``check_step`` on a step
before reading it, so it never loads a step ``latest_checkpoint`` calls invalid, and
``verify`` (``full_check``) runs everything a load reads without a model, so a step it
calls OK loads (into the model that wrote it).
"""
from __future__ import annotations

import os
from typing import Optional

from zeroshard.checkpoint import manifest, rng
from zeroshard.checkpoint.names import committed_steps
from zeroshard.checkpoint.checkpoint_errors import CheckpointCorruptError
from zeroshard.checkpoint.safe_fs import is_real_dir, read_small, regular_size
from zeroshard.checkpoint.shard_file import ShardReader, read_json, verify_file


def is_step_dir(path: str) -> bool:
    """``path`` is one step (it holds a manifest, or is named like one), not a root."""
    return os.path.lexists(os.path.join(path, manifest.MANIFEST)) or bool(
        manifest.STEP_RE.fullmatch(os.path.basename(os.path.normpath(path))))


def check_step(step_dir: str) -> dict:
    """The validated manifest of ``step_dir`` once every file it lists is a regular file of
    the listed size (cheap: no data read); raises CheckpointCorruptError with the reason.
    Data checksums are verified when data is read."""
    body = manifest.read(step_dir)
    for name, meta in body["files"].items():
        path = os.path.join(step_dir, name)
        size = regular_size(path)
        if size != meta["bytes"]:
            raise CheckpointCorruptError(f"{path} has {size} bytes, the manifest says {meta['bytes']} "
                                         "(truncated or damaged)")
    return body


def quick_check(step_dir: str) -> Optional[str]:
    """None when ``check_step`` passes, else the reason."""
    try:
        check_step(step_dir)
    except CheckpointCorruptError as exc:
        return str(exc)
    return None


def check_structure(step_dir: str) -> dict:
    """``check_step``, every RNG state and every data file's header against the pieces
    stored in it (reads the headers' blocks, not the data): what a load checks before it
    reads tensor data, without a model. Returns the manifest; raises CheckpointCorruptError."""
    body = check_step(step_dir)
    by_file: dict[str, list] = {}
    for name, meta in body["tensors"].items():
        for p in meta["pieces"]:
            by_file.setdefault(p["file"], []).append((name, p, meta["dtype"]))
    for name, meta in body["files"].items():
        path = os.path.join(step_dir, name)
        if name.endswith(".json"):
            rng.check(read_json(path, meta), path)
        else:
            reader = ShardReader(path, meta)
            for piece in by_file.get(name, ()):
                reader.check_piece(*piece)
            reader.release()
    return body


def full_check(step_dir: str) -> Optional[str]:
    """``check_structure`` and every block checksum of every file (reads the whole
    checkpoint): all a load checks without a model. None when intact, else the reason."""
    try:
        body = check_structure(step_dir)
        for name, meta in body["files"].items():
            if name.endswith(".safetensors"):
                verify_file(os.path.join(step_dir, name), meta)
    except CheckpointCorruptError as exc:
        return str(exc)
    return None


def candidates(root: str) -> list[str]:
    """Step directories under ``root`` to try, best first: the one ``latest`` names, then
    every committed step from the newest. Symlinked step directories are never followed."""
    order = [os.path.join(root, n) for _, n in reversed(committed_steps(root))
             if is_real_dir(os.path.join(root, n))]
    named = read_latest(root)
    if named is not None:
        path = os.path.join(root, named)
        if path in order:
            order.remove(path)
            order.insert(0, path)
    return order


def read_latest(root: str) -> Optional[str]:
    """The step name in ``root/latest``, or None when it is absent, not a regular file, or
    says anything but a step name (never followed as a path)."""
    try:
        named = read_small(os.path.join(root, manifest.LATEST), 256).decode("ascii").strip()
    except (CheckpointCorruptError, UnicodeDecodeError):
        return None
    return named if manifest.step_of(named) is not None else None


def latest_checkpoint(root: str, verify: bool = False) -> Optional[str]:
    """The newest valid step directory under ``root`` (the one ``latest`` names when it is
    intact), or None. ``verify=True`` also checks every data checksum (reads everything);
    otherwise data checksums are checked by ``load_checkpoint`` as it reads."""
    check = full_check if verify else quick_check
    for path in candidates(root):
        if check(path) is None:
            return path
    return None
