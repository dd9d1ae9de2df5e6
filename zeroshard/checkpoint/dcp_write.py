"""Saving a ZeroOptimizer's state as a torch Distributed Checkpoint (DCP), torchtitan's layout.

Each rank hands torch's own DCP machinery (``dcp.save`` with its ``FileSystemWriter`` and
``DefaultSavePlanner``) the pieces it owns: a flat range of a parameter becomes the few
row-major boxes that tile it (``boxes``), each a chunk with its global offsets; DCP's global plan
checks the chunks of every tensor cover it once. Around it, zeroshard's commit protocol: the
step is written into ``step-N.tmp-*``, torch writes ``.metadata`` last, rank 0 then writes
``zeroshard-dcp.json`` (every file's size and CRC32) beside it, fsyncs, and renames the
directory to ``step-N``; a save killed before the rename leaves only a ``.tmp-`` directory,
which no loader reads and the next save removes (Note [DCP format mapping]).
"""
from __future__ import annotations

import copy
import io
import json
import os
import shutil
import uuid
import warnings
from typing import TYPE_CHECKING, Callable, Optional, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from zeroshard.checkpoint import commit, dcp_metadata, jsontree, manifest, rng, stage_merge
from zeroshard.checkpoint.checkpoint_errors import CheckpointError
from zeroshard.checkpoint.dcp_stream_writer import StreamingWriter, save_blob
from zeroshard.checkpoint.dcp_summing import SummingFileSystem
from zeroshard.checkpoint.pieces import MASTER, PARAM, full_tensors, name_map, owned_pieces
from zeroshard.checkpoint import saver
from zeroshard.checkpoint.saver import PendingSave, checkpoint_comm, wait_checkpoint
from zeroshard.checkpoint.shard_file import Deferred, _materialize
from zeroshard.comm import Comm
from zeroshard.layout.boxes import boxes

if TYPE_CHECKING:
    from zeroshard.checkpoint.dcp_metadata import Stateful
    from zeroshard.optim.zero_optimizer import ZeroOptimizer

class Pieces:
    """One tensor's chunks on this rank, in torch DCP's checkpointable protocol (the methods
    DTensor implements): what to write, and each chunk's data when the writer asks."""

    def __init__(self, size: tuple[int, ...], dtype: torch.dtype) -> None:
        self.size, self.dtype = torch.Size(size), dtype
        self.flats: list["torch.Tensor | Deferred"] = []
        self.chunks: dict[tuple[int, ...], tuple[tuple[int, ...], int, int, int]] = {}

    def add(self, start: int, stop: int, flat: "torch.Tensor | Deferred") -> None:
        """``flat`` holds elements ``[start, stop)`` of the tensor."""
        self.flats.append(flat)
        for offsets, sizes, lo, hi in boxes(tuple(self.size), start, stop):
            self.chunks[offsets] = (sizes, len(self.flats) - 1, lo - start, hi - start)

    def stage(self, key: str, buffer: Callable[[str, torch.Tensor], torch.Tensor]) -> None:
        """Points the chunks at copies of the live tensors (an asynchronous save; a Deferred
        streams from its swap file)."""
        self.flats = [buffer(f"dcp|{key}|{i}", f) if isinstance(f, torch.Tensor) else f
                      for i, f in enumerate(self.flats)]

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
                              properties=TensorProperties(dtype=self.dtype), size=self.size))
                for offsets, (sizes, _, _, _) in self.chunks.items()]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, (s, _, _, _) in self.chunks.items()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        sizes, i, lo, hi = self.chunks[tuple(index.offset or ())]
        commit._point("dcp-chunk")  # (the writer is about to write this chunk)
        flat = _materialize(self.flats[i]).detach().reshape(-1)
        if flat.dtype != self.dtype or not flat.is_cpu:
            return flat[lo:hi].to(self.dtype).reshape(sizes)
        return exact_view(flat, lo, hi).reshape(sizes)


def exact_view(flat: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """``flat[lo:hi]`` as a tensor whose storage is exactly those elements, sharing memory.
    Why: torch's writer clones a view whose storage is larger (``torch.save`` would write the
    whole storage), a copy of every chunk of a flat partition; this view needs none."""
    es = flat.element_size()
    return torch.from_numpy(flat.view(torch.uint8).numpy()[lo * es:hi * es]).view(flat.dtype)


class _PiecesPlanner(DefaultSavePlanner):
    """torch's planner; it finds a chunk of a ``Pieces`` by its offsets (its own lookup finds
    only tensors, DTensors and ShardedTensors by offset)."""

    def lookup_object(self, index: MetadataIndex) -> object:
        obj = self.state_dict.get(index.fqn)
        if isinstance(obj, Pieces):
            return obj.__get_tensor_shard__(index)
        return super().lookup_object(index)

    def transform_object(self, write_item: WriteItem, object: object) -> object:
        # A bytes entry (a param-group option, the step, the scheduler's values: ~240 per save
        # in torchtitan's layout) as torch.save writes it, through ``save_blob``: the same
        # bytes without the per-record CRC32 or torch.save's own checks, 2.4x faster each here.
        if write_item.type == WriteItemType.BYTE_IO:
            out = io.BytesIO()
            save_blob(object, out)
            return out
        return super().transform_object(write_item, object)


def state_dict(model: Optional[nn.Module], opt: "ZeroOptimizer", step: int, scheduler: "Optional[Stateful]",
               dataloader: "Optional[Stateful]", extra: object, rank: int, world: int = 1) -> dict:
    """This rank's part of the checkpoint in torchtitan's layout (Note [DCP format mapping])."""
    names = name_map(model, opt)
    shapes = {names[seg.name]: tuple(seg.shape) for u in opt.engine.units for seg in u.layout.segments}
    model_sd: dict[str, object] = {}
    optim_sd: dict[str, object] = {}
    for rec in owned_pieces(model, opt):
        shape = shapes[rec.name]
        value = rec.tensors.get(MASTER, rec.tensors[PARAM])
        if rec.name not in model_sd:
            model_sd[rec.name] = Pieces(shape, torch.float32 if MASTER in rec.tensors else value.dtype)
        model_sd[rec.name].add(rec.start, rec.stop, value)  # type: ignore[attr-defined]
        for kind, t in rec.tensors.items():
            if kind.startswith("state."):
                key = f"state.{rec.name}.{kind[6:]}"
                if key not in optim_sd:
                    optim_sd[key] = Pieces(shape, t.dtype)
                optim_sd[key].add(rec.start, rec.stop, t)  # type: ignore[attr-defined]
        for k, v in rec.scalars.items():  # (Adam's step: FSDP2 keeps a float32 0-d tensor)
            optim_sd[f"state.{rec.name}.{k}"] = v.detach().clone().reshape(()) if isinstance(v, torch.Tensor) \
                else torch.tensor(float(v), dtype=torch.float32)
    # Each rank's RNG state and data position: JSON strings under per-rank keys (no rank's
    # copy is another's, and a loader never unpickles them; Note [DCP format mapping]).
    train: dict[str, object] = {"rng": {f"rank{rank}": json.dumps(rng.capture())}}
    if dataloader is not None:
        train["dataloader"] = {f"rank{rank}": json.dumps(jsontree.encode(dataloader.state_dict(), "dataloader"))}
    out: dict[str, object] = {"model": model_sd, "optimizer": optim_sd, "train_state": train}
    if rank == 0:  # (the others' copies would be deduplicated anyway)
        model_sd.update({n: t.detach().cpu() for n, t in full_tensors(model, opt)[0].items()})
        for g in opt.param_groups:
            options = {k: v for k, v in g.items() if k not in ("params", "optimizer_class")}
            for p in g["params"]:
                if p.requires_grad:
                    for k, v in options.items():
                        optim_sd[f"param_groups.{names[opt.engine.param_names[id(p)]]}.{k}"] = v
        train.update({"step": step, "world_size": world, **({"extra": extra} if extra is not None else {})})
        if scheduler is not None:
            out["lr_scheduler"] = scheduler.state_dict()
        if dataloader is not None:
            out["dataloader"] = dataloader.state_dict()
    return out


def save_dcp(root: str, step: int, model: Optional[nn.Module], opt: "ZeroOptimizer", scheduler: "Optional[Stateful]",
             dataloader: "Optional[Stateful]", extra: object, async_save: bool = False,
             keep_last: Optional[int] = None) -> PendingSave:
    """Writes ``root/step-NNNNNNNN`` as a DCP checkpoint (a collective). Asynchronous: the
    state is captured now (the small state as values, the tensors by reference), then the
    saver's background thread copies the tensors into its staging buffers (the optimizer's
    next step waits for that copy, as in a native async save) and writes and commits."""
    wait_checkpoint()
    if opt.engine.tp is not None or stage_merge.pipeline_of(opt) is not None:
        raise ValueError("save_checkpoint(format='dcp') supports data parallelism (one shard group, or a hybrid "
                         "mesh's), not tensor or pipeline parallelism; save the native format")
    replicas = opt.engine.replicas
    checkpoint_comm(opt)  # (its first use makes every shard group's side group: a collective of every rank)
    if replicas is not None:
        return _save_first_replica(replicas, root, step, model, opt, scheduler, dataloader, extra, keep_last)
    return _save(root, step, model, opt, scheduler, dataloader, extra, async_save, keep_last)


def _save_first_replica(replicas: Comm, root: str, step: int, model: Optional[nn.Module], opt: "ZeroOptimizer",
                        scheduler: "Optional[Stateful]", dataloader: "Optional[Stateful]", extra: object,
                        keep_last: Optional[int]) -> PendingSave:
    """Hybrid sharding: the first replica's shard group writes every chunk, synchronously, while
    the other replicas wait for its verdict (Note [DCP under hybrid sharding])."""
    failed, handle = False, None
    if replicas.rank == 0:
        try:
            handle = _save(root, step, model, opt, scheduler, dataloader, extra, False, keep_last)
        except BaseException:
            replicas.any_true(True)
            raise
    if replicas.any_true(failed):
        raise CheckpointError(f"DCP checkpoint of step {step}: the first replica failed to save it; nothing was "
                              "committed: the previous checkpoint is intact")
    return handle or PendingSave(saver._SAVER, os.path.join(os.fspath(root), manifest.step_dir_name(step)))


# Note [DCP under hybrid sharding]
# Under a (replicate, shard) mesh every replica holds the same shards, so one copy is the
# checkpoint: replica 0's shard group runs ``dcp.save`` on its side group (``checkpoint_comm``,
# the native saver's), each rank writing the chunks it owns, and the other replicas wait for
# its verdict (``replicas.any_true``), so every rank returns with the step committed or raises.
# torch's own route would be one ``dcp.save`` over the whole world with every replica offering
# its chunks: ``dedup_save_plans`` keeps each duplicate write item on one rank (balanced by
# size), and the replicated bytes entries too; but the per-rank RNG and data-position keys
# (``train_state.rng.rank{r}``) would then be world ranks, which a load under the mesh (whose
# comm is the shard group) could not pair with its own rank. So the layout is the one a plain
# data-parallel run of the shard group's size writes: FSDP2 loads it at any world, zeroshard
# under the mesh (each replica reads the chunks its shard-group rank owns) or at any world.
# The save is synchronous (as the native hybrid save): an ``async_save`` request saves at once.
# Limits as native: the RNG states and data positions are the first replica's.


def _save(root: str, step: int, model: Optional[nn.Module], opt: "ZeroOptimizer", scheduler: "Optional[Stateful]",
          dataloader: "Optional[Stateful]", extra: object, async_save: bool, keep_last: Optional[int]) -> PendingSave:
    """``save_dcp`` on the ranks that write (one shard group)."""
    comm = checkpoint_comm(opt)
    final = os.path.join(os.fspath(root), manifest.step_dir_name(step))
    # One collective before the write (an async save's stall): rank 0's new directory and
    # every rank's verdict on building its part travel together.
    made, error, sd = None, None, {}
    if comm.rank == 0:
        try:
            os.makedirs(root, exist_ok=True)
            commit._remove_stale(root)
            made = f"{final}.tmp-{uuid.uuid4().hex[:12]}"
            os.mkdir(made)
        except OSError as exc:
            made, error = None, f"rank 0: cannot create a step directory under {root!r}: {exc}"
    commit._point("dcp-begin")
    try:
        if error is None:
            opt.engine.inflight.check(f"save_checkpoint of step {step}")
            sd = state_dict(model, opt, step, scheduler, dataloader, extra, comm.rank, comm.world_size)
            if async_save:  # (the small state as values: training changes the live objects next)
                sd = {k: v if k in ("model", "optimizer") else copy.deepcopy(v) for k, v in sd.items()}
    except Exception as exc:  # noqa: BLE001 - every rank hears of it below
        error = f"rank {comm.rank}: {type(exc).__name__}: {exc}"
    gathered = comm.all_gather_object((error, made))
    errors = [e for e, _ in gathered if e]
    tmp = gathered[0][1]
    if errors or not isinstance(tmp, str):
        if comm.rank == 0 and made is not None:
            shutil.rmtree(made, ignore_errors=True)
        raise CheckpointError(f"DCP checkpoint of step {step} was not saved ({errors[0] if errors else 'no directory'})"
                              "; nothing was committed: the previous checkpoint is intact")
    if not async_save:
        return PendingSave(saver._SAVER, _write(sd, tmp, final, step, comm, keep_last))
    streamed = any(isinstance(f, Deferred) for part in sd.values() if isinstance(part, dict)
                   for v in part.values() if isinstance(v, Pieces) for f in v.flats)
    return saver._SAVER.background(opt, lambda: _stage(sd), lambda: _write(sd, tmp, final, step, comm, keep_last), streamed)


def write_state(root: str, step: int, sd: dict) -> str:
    """Writes state dict ``sd`` (tensors, ``Pieces``, values) as ``root/step-N`` in this one
    process, with the commit protocol of ``save_dcp`` (an offline conversion's writer)."""
    final = os.path.join(root, manifest.step_dir_name(step))
    os.makedirs(root, exist_ok=True)
    commit._remove_stale(root)
    tmp = f"{final}.tmp-{uuid.uuid4().hex[:12]}"
    os.mkdir(tmp)
    return _write(sd, tmp, final, step, Comm(None))


def _stage(sd: dict) -> None:
    """Copies every live tensor of ``sd`` into the saver's reused staging buffers."""
    pin = torch.cuda.is_available()
    used: set[str] = set()

    def buffer(key: str, t: torch.Tensor) -> torch.Tensor:
        used.add(key)
        return saver._SAVER.buffer(key, t, pin)
    for section in ("model", "optimizer"):
        part = sd[section]
        for key, v in part.items():
            if isinstance(v, Pieces):
                v.stage(f"{section}.{key}", buffer)
            elif isinstance(v, torch.Tensor):
                part[key] = buffer(f"dcp|{section}.{key}", v)
    saver._SAVER.drop_unused(used, lambda key: key.startswith("dcp|"))


def _write(sd: dict, tmp: str, final: str, step: int, comm: "Comm", keep_last: Optional[int] = None) -> str:
    """torch's DCP writer, the checksums and the commit; returns the step directory."""
    error, sums = None, {}
    try:
        fs = SummingFileSystem()
        # (chunk blobs written one at a time without touching torch.save's global CRC32 switch:
        # Note [DCP streaming writer])
        dcp.save(sd, storage_writer=StreamingWriter(tmp, fs), planner=_PiecesPlanner(), process_group=comm.group,
                 no_dist=not dist.is_initialized())
        commit._point("dcp-written")
        sums = {n: {"size": size, "crc32": crc} for n, (size, crc) in fs.sums.items()
                if n == dcp_metadata.METADATA or n.endswith(".distcp")}
    except Exception as exc:  # noqa: BLE001 - every rank hears of it below
        error = f"rank {comm.rank}: {type(exc).__name__}: {exc}"
    gathered = comm.all_gather_object((error, sums))
    errors = [e for e, _ in gathered if e]
    if not errors and comm.rank == 0:
        try:
            _seal(tmp, final, step, {n: v for _, part in gathered for n, v in part.items()}, keep_last)
        except Exception as exc:  # noqa: BLE001 - the other ranks wait for the verdict below
            errors = [f"rank 0: {type(exc).__name__}: {exc}"]
    errors = cast(list, comm.broadcast_object(errors))
    if errors:
        if comm.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"DCP checkpoint of step {step} was not saved ({errors[0]}); nothing was committed: "
                              "the previous checkpoint is intact")
    return final


def _seal(tmp: str, final: str, step: int, files: dict[str, dict[str, int]], keep_last: Optional[int]) -> None:
    """Rank 0, after torch wrote ``.metadata``: the checksum file, then the commit (rename),
    then ``keep_last`` rotation (Note [retention across formats] in commit.py)."""
    if dcp_metadata.METADATA not in files:
        raise CheckpointError(f"{tmp}: torch wrote no {dcp_metadata.METADATA}")
    with open(os.path.join(tmp, dcp_metadata.CHECKSUMS), "w") as f:
        json.dump({"format": "zeroshard-dcp", "version": 1, "step": step, "files": files}, f)
        f.flush()
        commit._point("dcp-sums")
        os.fsync(f.fileno())
    commit._fsync_dir(tmp)
    commit._point("dcp-rename")
    if os.path.isdir(final):  # (saving a step again: the old one goes once the new one is whole)
        trash = f"{final}.trash-{uuid.uuid4().hex[:12]}"
        os.rename(final, trash)
        shutil.rmtree(trash, ignore_errors=True)
    os.rename(tmp, final)
    commit._fsync_dir(os.path.dirname(final))
    if keep_last is not None:  # (after the commit: a failure here leaves the new step saved)
        try:
            commit.rotate(os.path.dirname(final), keep_last, keep=os.path.basename(final))
        except OSError as exc:
            warnings.warn(f"DCP checkpoint of step {step} was committed to {final}, but rotating out older steps "
                          f"failed ({exc}); older steps may remain on disk", RuntimeWarning, stacklevel=2)
