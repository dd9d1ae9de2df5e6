"""The commit protocol: how a captured training state becomes a visible step directory.

1. rank 0 creates ``root/step-N.tmp-<nonce>`` and tells the others its name;
2. every rank writes its data file and its RNG file there, each fsynced, checksummed while
   written; every rank reports success or its error to rank 0 (so a full disk on one rank
   fails the save on all ranks instead of leaving them blocked);
3. rank 0 writes ``manifest.json`` (fsynced), fsyncs the directory, renames it to
   ``step-N`` and fsyncs ``root``; only now is the step visible;
4. rank 0 points ``latest`` at it (write ``latest.tmp-<nonce>``, fsync, ``os.replace``).
   This is the commit point for ``load_checkpoint(root)``: ``latest`` is tried first (so a
   run resumed from an earlier step and saving again is not shadowed by the abandoned
   later steps); the other complete steps are fallbacks, newest first;
5. ``keep_last`` rotation renames old steps to ``*.trash-*`` before deleting them, so a
   half-deleted step never looks committed, and it never touches the step just written.
   The deleting runs on a background thread (Note [deleting in the background]).

Every rank must see ``root`` on one shared filesystem (rank 0 renames the directory the
others wrote into). A crash at any point leaves at worst a ``*.tmp-*``/``*.trash-*`` directory that loaders
ignore and the next save removes; the previous step stays loadable.
"""
from __future__ import annotations

import math
import os
import shutil
import threading
import uuid
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from zeroshard.checkpoint import dcp_metadata, manifest
from zeroshard.checkpoint.checkpoint_errors import CheckpointError
from zeroshard.checkpoint.locate import quick_check
from zeroshard.checkpoint.names import committed_steps
from zeroshard.checkpoint.pieces import PieceRecord
from zeroshard.checkpoint.safe_fs import is_real_dir
from zeroshard.checkpoint.shard_file import CODES, Deferred, WrittenFile, write_json, write_shard
from zeroshard.checkpoint.pieces import gather_table
from zeroshard.testing import kill_points

FaultHook = Optional[Callable[[str], None]]
fault_hook: FaultHook = None
"""Tests set this to a function called at each named point of the protocol (to SIGKILL the
process there); None in normal use."""


def _point(name: str) -> None:
    if fault_hook is not None:
        fault_hook(name)
    if kill_points.ARMED is not None:  # (fault tests only: the save of step steps_done, Note [kill points])
        kill_points.hit("save", kill_points.steps_done)


@dataclass
class Snapshot:
    """Everything one rank contributes to a checkpoint, captured at one instant."""

    step: int
    records: list[PieceRecord]
    full: dict[str, torch.Tensor]  # rank 0 only: buffers and frozen parameters
    rng: dict
    dataloader: Any  # this rank's encoded data position (or None)
    header: dict = field(default_factory=dict)  # rank 0: world size, stage, groups, trainer
    own: dict[str, torch.Tensor] = field(default_factory=dict)  # this rank's alone (codec_residuals.py)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_rank_files(snap: Snapshot, tmp: str, rank: int) -> tuple[list[WrittenFile], list[dict]]:
    tensors: list[tuple[str, torch.Tensor | Deferred]] = []
    entries: list[dict] = []
    fname = manifest.data_file(rank)
    for rec in snap.records:
        entries.append({"name": rec.name, "start": rec.start, "stop": rec.stop, "file": fname,
                        "keys": {kind: rec.key(kind) for kind in rec.tensors}, "scalars": rec.scalars})
    tensors += _run_major(snap.records)
    for name, t in snap.full.items():
        tensors.append((f"{name}|full", t))
        entries.append({"name": name, "start": 0, "stop": math.prod(t.shape), "file": fname,  # (t may be Deferred)
                        "keys": {"param": f"{name}|full"}, "scalars": {}})
    tensors += list(snap.own.items())
    _point("before_data")
    data = write_shard(os.path.join(tmp, fname), tensors, {"format": manifest.FORMAT, "rank": str(rank)},
                       on_chunk=(lambda: _point("data_chunk")) if fault_hook else None)
    _point("after_data")
    rng = write_json(os.path.join(tmp, manifest.rng_file(rank)), snap.rng)
    return [data, rng], entries


def _run_major(records: list[PieceRecord]) -> list[tuple[str, torch.Tensor | Deferred]]:
    """The records' tensors in file order: the pieces of one optimizer run kind by kind (all
    its parameters, then all of each state), so that a run's state is one range of the file
    and a load can adopt it without a copy (Note [adopting verified state] in load.py)."""
    out: list[tuple[str, torch.Tensor | Deferred]] = []
    i = 0
    while i < len(records):
        j = i + 1
        while j < len(records) and records[i].run is not None and records[j].run == records[i].run:
            j += 1
        group = records[i:j]
        for kind in dict.fromkeys(k for rec in group for k in rec.tensors):
            out += [(rec.key(kind), rec.tensors[kind]) for rec in group if kind in rec.tensors]
        i = j
    return out


def commit(snap: Snapshot, root: str, comm: Any, shapes: dict[str, dict], keep_last: Optional[int]) -> str:
    """Runs the protocol on every rank of ``comm``; returns the committed step directory."""
    rank = comm.rank
    final = os.path.join(root, manifest.step_dir_name(snap.step))
    made: Optional[str] = None  # rank 0: the step directory it made, or "!" and why it could not
    if rank == 0:
        _point("begin")
        wait_discarded()  # the previous save's deletions: the space they free is this save's
        try:
            os.makedirs(root, exist_ok=True)
            _remove_stale(root)
            made = f"{final}.tmp-{uuid.uuid4().hex[:12]}"
            os.mkdir(made)
        except OSError as exc:
            made = f"!{exc}"
    tmp: str = comm.broadcast_object(made)
    if tmp.startswith("!"):
        raise CheckpointError(f"cannot create a step directory under {root!r}: {tmp[1:]}")
    try:
        files, entries = _write_rank_files(snap, tmp, rank)
        result: Any = ([f.__dict__ for f in files], entries, snap.dataloader)
    except OSError as exc:
        result = f"!rank {rank}: {exc.strerror or exc} writing {exc.filename or tmp}"  # ("!": the disk's)
    except Exception as exc:  # noqa: BLE001 - reported to every rank, then raised there
        result = f"rank {rank}: {type(exc).__name__}: {exc}"
    results = comm.all_gather_object(result)
    errors = [r for r in results if isinstance(r, str)]
    disk = any(e.startswith("!") for e in errors)  # (only a write error is the disk's to fix)
    errors = [e.lstrip("!") for e in errors]
    failure = None  # rank 0's commit error, if any
    if rank == 0:
        try:
            failure = _finish(snap, root, tmp, final, results, shapes, keep_last) if not errors else None
        except Exception as exc:  # noqa: BLE001 - the other ranks wait for the verdict below
            failure = f"{'!' if isinstance(exc, OSError) else ''}rank 0: {type(exc).__name__}: {exc}"
        if errors or failure:
            shutil.rmtree(tmp, ignore_errors=True)
    failure = comm.broadcast_object(failure)
    if failure:
        disk, failure = disk or failure.startswith("!"), failure.lstrip("!")
    if errors or failure:
        msg = "; ".join(errors) if errors else failure
        fix = "free disk space or choose another root" if disk else "the cause above is not the disk's"
        raise CheckpointError(f"checkpoint of step {snap.step} was not saved ({msg}). Nothing was "
                              f"committed: the previous checkpoint is intact and training can go on; {fix}")
    return final


def _finish(snap: Snapshot, root: str, tmp: str, final: str, results: list, shapes: dict,
            keep_last: Optional[int]) -> Optional[str]:
    """Rank 0's part after every rank wrote its files; returns an error message or None."""
    body = dict(snap.header)
    body["files"] = {f["name"]: WrittenFile(**f).to_json() for files, _, _ in results for f in files}
    body["tensors"] = gather_table([entries for _, entries, _ in results], shapes)
    body["trainer"] = {**body.get("trainer", {}), "dataloader": [dl for _, _, dl in results]}
    committed = False  # True once `latest` names the new step: from then on it is the checkpoint
    trash = None
    # The loader's own checks, so a save never commits a manifest a load would refuse.
    manifest.validate(body, os.path.join(tmp, manifest.MANIFEST))
    try:
        manifest.write(os.path.join(tmp, manifest.MANIFEST), body)
        _fsync_dir(tmp)
        _point("before_rename")
        if os.path.exists(final):  # re-saving a step: move the old one aside first
            trash = f"{final}.trash-{uuid.uuid4().hex[:12]}"
            os.rename(final, trash)
        os.rename(tmp, final)
        _fsync_dir(root)
        _point("after_rename")
        committed = _set_latest(root, os.path.basename(final))
        _point("after_latest")
        if trash:
            _discard(trash)
        if keep_last is not None:
            rotate(root, keep_last, keep=os.path.basename(final))
    except OSError as exc:
        what = f"{exc.strerror or exc} at {exc.filename or tmp}"
        if committed:  # cleanup after the commit point failed: the step itself is saved
            warnings.warn(f"checkpoint of step {snap.step} was committed to {final}, but cleaning up "
                          f"after it failed ({what}); older steps may remain on disk", RuntimeWarning,
                          stacklevel=2)
            return None
        _undo(final, tmp, trash)
        return f"rank 0: {what} committing {tmp}"
    return None


def _undo(final: str, tmp: str, trash: Optional[str]) -> None:
    """Before the commit point: take the new step out of sight again and put back the step
    it replaced, so "nothing was committed" is true."""
    if os.path.isdir(final) and not os.path.isdir(tmp):
        try:
            os.rename(final, tmp)  # the caller removes tmp
        except OSError:
            pass
    if trash is not None and not os.path.exists(final):
        try:
            os.rename(trash, final)
        except OSError:
            pass


def _set_latest(root: str, name: str) -> bool:
    tmp = os.path.join(root, f"{manifest.LATEST}.tmp-{uuid.uuid4().hex[:12]}")
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, manifest.LATEST))
    try:
        _fsync_dir(root)
    except OSError as exc:  # the replace happened: the step is committed, if not yet durable
        warnings.warn(f"{root}: fsync after pointing latest at {name} failed ({exc})", RuntimeWarning,
                      stacklevel=3)
    return True


def rotate(root: str, keep_last: int, keep: str) -> None:
    """Deletes the oldest valid steps beyond ``keep_last``; never ``keep`` nor the only valid one.
    Native and DCP steps under one root count alike (Note [retention across formats])."""
    valid = [n for _, n in committed_steps(root) if _intact(os.path.join(root, n))]
    doomed = [n for n in valid[:max(0, len(valid) - keep_last)] if n != keep]
    for n in doomed:
        _point("rotate")
        trash = os.path.join(root, f"{n}.trash-{uuid.uuid4().hex[:12]}")
        os.rename(os.path.join(root, n), trash)
        _discard(trash)


def _intact(step_dir: str) -> bool:
    """A committed step a load would take: a native one passing ``quick_check``, or a DCP one
    (a real directory holding ``.metadata``) whose checksum file matches."""
    if dcp_metadata.is_dcp_dir(step_dir):
        return dcp_metadata.verify(step_dir) is None
    return quick_check(step_dir) is None


# Note [retention across formats]
# A root may hold native and DCP steps (a run that switched formats, or converted in place).
# ``keep_last`` counts both kinds by step number, with the checks each loader makes before it
# reads a step (``quick_check``; DCP: every file's size and the CRC32 of ``.metadata``). A step
# that fails them (a save killed after the rename, a file cut short) is neither counted nor
# deleted, so a torn newest save never pushes an older whole step out; ``*.tmp-*`` leftovers
# of a save killed before its commit are not steps at all. Rotation runs on rank 0 after the
# new step's rename, whichever format wrote it, and renames each doomed step to ``*.trash-*``
# before deleting it (Note [deleting in the background]).


# Note [deleting in the background]
# Deleting a rotated-out step of gigabytes took 0.25-0.57 s on the benchmark's VM (ext4
# mounted with `discard`: the unlink trims the extents), a quarter of a 2 GB save, after the
# step was already committed. The rename to `*.trash-*` is what makes rotation safe (a
# half-deleted step never looks committed), so what follows it need not hold the caller: a
# thread deletes it, and the next save waits for that thread before it starts (its space is
# the next save's, and deletions never pile up); so does a load (overlapping the deletion
# slowed a 2 GB load from ~1.1 to ~1.55 s: both want the disk). The threads are not daemons, so the
# interpreter lets them finish at exit; a process killed meanwhile leaves a `*.trash-*`
# directory, which loaders ignore and the next save removes (`_remove_stale`).
_DISCARDING: list[threading.Thread] = []


def _discard(path: str) -> None:
    thread = threading.Thread(target=shutil.rmtree, args=(path,), kwargs={"ignore_errors": True},
                              name="zeroshard-discard")
    thread.start()
    _DISCARDING.append(thread)


def wait_discarded() -> None:
    """Waits until the steps this process rotated out are deleted."""
    while _DISCARDING:
        _DISCARDING.pop().join()


def _remove_stale(root: str) -> None:
    """Leftovers of saves or rotations that crashed (never visible as committed steps)."""
    for n in os.listdir(root):
        if (".tmp-" in n or ".trash-" in n) and n.startswith(("step-", manifest.LATEST)):
            path = os.path.join(root, n)
            if is_real_dir(path):  # a symlink is unlinked, never followed
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)


def tensor_meta(t: torch.Tensor, shape: Any, group: Optional[int]) -> dict:
    return {"shape": list(shape), "dtype": CODES[t.dtype], "group": group}
