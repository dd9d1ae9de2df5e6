"""Finding a loadable step: ``latest``, then the newest step that passes its checks."""
from __future__ import annotations

import os
from typing import Optional

from zeroshard.checkpoint import manifest
from zeroshard.checkpoint.commit import committed_steps
from zeroshard.checkpoint.errors import CheckpointCorruptError
from zeroshard.checkpoint.shard_file import read_json, verify_file


def is_step_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, manifest.MANIFEST)) or bool(
        manifest.STEP_RE.match(os.path.basename(os.path.normpath(path))))


def quick_check(step_dir: str) -> Optional[str]:
    """None when the manifest is intact and every file it lists has the listed size (cheap:
    no data read); otherwise the reason. Data checksums are verified when data is read."""
    try:
        body = manifest.read(step_dir)
    except CheckpointCorruptError as exc:
        return str(exc)
    for name, meta in body["files"].items():
        path = os.path.join(step_dir, name)
        try:
            size = os.path.getsize(path)
        except OSError:
            return f"{path} is missing"
        if size != meta["bytes"]:
            return f"{path} has {size} bytes, the manifest says {meta['bytes']} (truncated or damaged)"
    return None


def full_check(step_dir: str) -> Optional[str]:
    """``quick_check`` plus every block checksum of every file (reads the whole checkpoint)."""
    reason = quick_check(step_dir)
    if reason is not None:
        return reason
    body = manifest.read(step_dir)
    for name, meta in body["files"].items():
        try:
            if name.endswith(".json"):
                read_json(os.path.join(step_dir, name), meta)
            else:
                verify_file(os.path.join(step_dir, name), meta)
        except CheckpointCorruptError as exc:
            return str(exc)
    return None


def candidates(root: str) -> list[str]:
    """Step directories under ``root`` to try, best first: the one ``latest`` names, then
    every committed step from the newest."""
    order = [os.path.join(root, n) for _, n in reversed(committed_steps(root))]
    try:
        with open(os.path.join(root, manifest.LATEST)) as f:
            named = f.read(256).strip()
    except OSError:
        named = ""
    if manifest.STEP_RE.match(named):  # never follow anything else that `latest` might say
        path = os.path.join(root, named)
        if path in order:
            order.remove(path)
            order.insert(0, path)
    return order


def latest_checkpoint(root: str, verify: bool = False) -> Optional[str]:
    """The newest valid step directory under ``root`` (the one ``latest`` names when it is
    intact), or None. ``verify=True`` also checks every data checksum (reads everything);
    otherwise data checksums are checked by ``load_checkpoint`` as it reads."""
    check = full_check if verify else quick_check
    for path in candidates(root):
        if check(path) is None:
            return path
    return None
