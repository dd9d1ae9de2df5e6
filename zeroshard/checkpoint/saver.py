"""``save_checkpoint`` and the one object with a lifecycle behind it: the process's saver.

States: IDLE -> (sync) COMMITTING -> IDLE, or (async) STAGING -> WRITING -> IDLE | FAILED.

- A synchronous save writes straight from the live tensors (no copy) and returns once the
  step is committed.
- An asynchronous save captures the small state (RNG, scheduler, data position, scalars,
  extra) at once, then a background thread copies the tensors into staging buffers
  (reused across saves) and runs the same commit protocol. Training goes on meanwhile:
  only ``optimizer.step()`` modifies the saved tensors, so a step pre-hook on the optimizer
  waits until staging is done (forward and backward overlap it). At most one save is in
  flight: the next save or load waits for it, and re-raises its error if it failed.
- Collectives of a save run on a dedicated gloo group, so a background commit never
  interleaves with training collectives on the data-parallel group.
"""
from __future__ import annotations

import datetime
import enum
import json
import os
import threading
import weakref
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from zeroshard.checkpoint import codec_residuals, commit, frozen_base, jsontree, manifest, rng, stage_merge, validate
from zeroshard.checkpoint.checkpoint_errors import CheckpointCorruptError, CheckpointError
from zeroshard.checkpoint.pieces import PieceRecord, full_tensors, has_deferred, name_map, owned_pieces
from zeroshard.checkpoint.shard_file import CODES, COMPLEX_CODES, Deferred
from zeroshard.comm import Comm
from zeroshard.optim.registry import optimizer_for
from zeroshard.optim.zero_optimizer import engine_of

if TYPE_CHECKING:
    from zeroshard.optim.zero_optimizer import ZeroOptimizer


class SaveState(enum.Enum):
    IDLE = "idle"
    STAGING = "staging"
    WRITING = "writing"
    FAILED = "failed"


class PendingSave:
    """Handle of a save; ``wait()`` returns the committed step directory or raises."""

    def __init__(self, saver: "CheckpointSaver", path: Optional[str] = None) -> None:
        self._saver, self.path = saver, path

    def wait(self) -> str:
        self._saver.wait()
        commit.wait_discarded()
        if self.path is None:  # (an asynchronous save sets it once committed; a failure raised earlier)
            raise CheckpointError("this asynchronous checkpoint save was not committed: it failed, and an "
                                  "earlier wait raised its error")
        return self.path


class CheckpointSaver:
    def __init__(self) -> None:
        self.state = SaveState.IDLE
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._staged = threading.Event()
        self._staged.set()
        self._buffers: dict[str, torch.Tensor] = {}
        self._hooked: set[int] = set()
        self._comms: dict[object, tuple[Optional["weakref.ref[dist.ProcessGroup]"], Comm]] = {}
        """Side groups by the group they serve, with a weak reference to it: an id is reused once its
        group is freed (a group re-formed at another world, Note [in-process recovery]), and the
        cache must neither hand out the old world's side group nor keep that group alive."""

    # -- lifecycle -------------------------------------------------------------------------
    def wait(self) -> None:
        """Blocks until the in-flight save (if any) is committed; raises its error once."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            self.state = SaveState.IDLE
            raise CheckpointError(f"the previous asynchronous checkpoint save failed: {err}") from err

    def _comm(self, opt: Optional["ZeroOptimizer"]) -> Comm:
        engine = engine_of(opt)
        base = engine.comm if engine is not None else Comm(None)
        tp = engine.tp if engine is not None else None  # tensor parallel: every rank of dp x tp writes its part
        pp = stage_merge.pipeline_of(opt)  # pipeline parallel: every rank of the mesh (Note [pipeline checkpoints])
        if base.world_size == 1 and tp is None and pp is None:
            return base
        key: object = id(base.group)
        served: Optional[dist.ProcessGroup] = base.group
        if pp is not None:
            key, served = ("pp", pp.checkpoint_ranks), None
        elif tp is not None:
            key, served = ("tp", id(tp.comm.group)), tp.comm.group
        held = self._comms.get(key)
        if held is not None and held[0] is not None and held[0]() is not served:
            held = None  # (the id of a freed group, now another's)
        if held is None:
            self._comms = {k: v for k, v in self._comms.items() if v[0] is None or v[0]() is not None}
            # The side group must give up on a dead peer as soon as training's own group does
            # (not after gloo's 30-minute default): ZEROSHARD_PG_TIMEOUT, seconds.
            timeout = datetime.timedelta(seconds=float(os.environ.get("ZEROSHARD_PG_TIMEOUT", "1800")))
            mine = list(pp.checkpoint_ranks) if pp is not None else \
                dist.get_process_group_ranks(base.group) if tp is None else tp.checkpoint_ranks
            # new_group is a collective of the whole world: under a hybrid mesh every rank makes
            # every shard group's side group, in the same order (Note [hybrid sharding]).
            rows = (engine.shard_group_ranks if engine is not None else None) or [mine]
            for ranks in rows:
                group = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
                if sorted(ranks) == sorted(mine):
                    self._comms[key] = (weakref.ref(served) if served is not None else None, Comm(group))
        return self._comms[key][1]

    def save(self, root: str, step: int, model: Optional[nn.Module], opt: Any, scheduler: Any,
             dataloader: Any, extra: Any, async_save: bool, keep_last: Optional[int],
             first_replica: bool = False, save_frozen: bool = False,
             residuals: Optional[dict[str, torch.Tensor]] = None) -> PendingSave:
        self.wait()
        root = _check_arguments(root, step, keep_last, async_save)
        comm = self._comm(opt)
        engine = engine_of(opt)  # (a ZeroOptimizer's; any torch.optim optimizer saves)
        replicas = engine.replicas if engine is not None else None
        if replicas is not None and not first_replica:  # hybrid: the first replica writes (all hold the same shards)
            return self._save_replicated(replicas, root, step, model, opt, scheduler, dataloader, extra, keep_last,
                                         save_frozen)
        # Capture and the loader's checks on every rank, then agree: a rank that cannot save
        # (a lambda in its sampler state) must not leave the others waiting in the commit.
        managed = opt if opt is not None else optimizer_for(model) if model is not None else None
        managed_engine = engine_of(managed) if engine is None else engine
        if managed_engine is not None and managed_engine.shards_parameters:
            managed_engine.stage3_gatherer.settle()  # units an unfinished forward left gathered (Note [saving between steps])
        error: Optional[BaseException] = None
        pp = stage_merge.pipeline_of(opt)
        try:
            if engine is not None:  # a step that failed part way left no state worth saving (Note [failed steps])
                engine.inflight.check(f"save_checkpoint of step {step}")
            snap = _capture(step, model, opt, scheduler, dataloader, extra, comm.world_size, save_frozen,
                            writes_full=pp.writes_full if pp is not None else comm.rank == 0, residuals=residuals)
            shapes = _shapes(model, opt, save_frozen)
        except (TypeError, ValueError, RuntimeError) as exc:  # (CheckpointError is one)
            error = exc
        others = [e for e in comm.all_gather_object(None if error is None else f"rank {comm.rank}: {error}") if e]
        if error is not None:
            raise error
        if others:
            raise CheckpointError(f"checkpoint of step {step} was not saved: {others[0]}. Nothing was committed")
        if pp is not None:  # one manifest over every stage (Note [pipeline checkpoints])
            shapes = stage_merge.merge_save(pp, snap, shapes, full_names(model, opt, save_frozen))
        if comm.rank != 0:
            snap.header = {}
        if not async_save:
            self.state = SaveState.WRITING
            try:
                return PendingSave(self, commit.commit(snap, root, comm, shapes, keep_last))
            finally:
                self.state = SaveState.IDLE
        # State in swap files (Deferred) is not copied to memory: it streams from the files,
        # so the next optimizer step, which rewrites them, waits for the whole write.
        return self.background(opt, lambda: self._stage(snap), lambda: commit.commit(snap, root, comm, shapes,
                                                                                      keep_last),
                               streamed=has_deferred(snap.records))

    def background(self, opt: Optional[torch.optim.Optimizer], stage: Callable[[], None], write: Callable[[], str], streamed: bool) -> PendingSave:
        """Runs an asynchronous save on the background thread: ``stage`` copies the tensors
        (the optimizer's next step waits for it; for the whole save when ``streamed``), then
        ``write`` commits and returns the step directory. Both formats' async saves go here."""
        if opt is not None and id(opt) not in self._hooked:
            opt.register_step_pre_hook(self._before_step)
            self._hooked.add(id(opt))
        self._staged.clear()
        self.state = SaveState.STAGING
        handle = PendingSave(self)
        self._thread = threading.Thread(target=self._run, args=(stage, write, streamed, handle),
                                        name="zeroshard-async-save")
        self._thread.start()
        if opt is None:  # no optimizer step to hook: the caller may change anything next
            self._staged.wait()
        return handle

    def _save_replicated(self, replicas: Comm, root: str, step: int, model: Optional[nn.Module], opt: Any,
                         scheduler: Any, dataloader: Any, extra: Any, keep_last: Optional[int],
                         save_frozen: bool) -> PendingSave:
        """Hybrid sharding: replica 0's shard group writes the checkpoint (synchronously) while
        the other replicas wait for its commit, so every rank returns with it committed. The
        RNG files are replica 0's: on resume every replica continues from them. The gradient
        residuals are every replica's (Note [residuals of every replica] in codec_residuals.py)."""
        handle = PendingSave(self)
        failed = False
        residuals = codec_residuals.replica_tensors(opt, replicas)
        if replicas.rank == 0:
            try:
                handle = self.save(root, step, model, opt, scheduler, dataloader, extra, False, keep_last,
                                   first_replica=True, save_frozen=save_frozen, residuals=residuals)
            except BaseException:
                failed = True
                replicas.any_true(True)
                raise
        if replicas.any_true(failed):
            raise CheckpointError(f"checkpoint of step {step}: the first replica failed to save it")
        if handle.path is None:  # the other replicas: the step directory the first one committed
            handle.path = os.path.join(root, manifest.step_dir_name(step))
        return handle

    def _before_step(self, *_: Any) -> None:
        # The optimizer is about to modify the tensors being staged: wait for the copy.
        self._staged.wait()

    def _run(self, stage: Callable[[], None], write: Callable[[], str], streamed: bool, handle: PendingSave) -> None:
        try:
            try:
                stage()
            finally:
                if not streamed:
                    self._staged.set()
            self.state = SaveState.WRITING
            handle.path = write()
            self.state = SaveState.IDLE
        except BaseException as exc:  # noqa: BLE001 - surfaced by the next wait()
            self._error = exc
            self.state = SaveState.FAILED
        finally:
            self._staged.set()

    def _stage(self, snap: commit.Snapshot) -> None:
        """Copies every tensor of the snapshot into reused CPU buffers."""
        pin = torch.cuda.is_available()
        used = set()
        for rec in snap.records:
            for kind, t in list(rec.tensors.items()):
                if isinstance(t, Deferred):
                    continue
                rec.tensors[kind] = self._buffer(rec.key(kind), t, pin)
                used.add(rec.key(kind))
        for name, t in list(snap.full.items()):
            snap.full[name] = self._buffer(f"{name}|full", t, pin)
            used.add(f"{name}|full")
        self.drop_unused(used, lambda key: not key.startswith("dcp|"))

    def drop_unused(self, used: set[str], mine: Callable[[str], bool]) -> None:
        """Layout changed: drops the buffers of one format's staging (``mine``) it no longer
        uses; the other format's stay, so a run that saves both reuses both."""
        for key in [k for k in self._buffers if mine(k) and k not in used]:
            del self._buffers[key]

    def buffer(self, key: str, t: torch.Tensor, pin: bool) -> torch.Tensor:
        """A copy of ``t`` in a staging buffer reused across saves (another format's staging,
        its keys starting ``dcp|``)."""
        return self._buffer(key, t, pin)

    def _buffer(self, key: str, t: torch.Tensor, pin: bool) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            self._buffers[key] = buf
        buf.copy_(t, non_blocking=pin)
        return buf


def _encode_state(obj: Any, what: str) -> Any:
    if obj is None:
        return None
    if not hasattr(obj, "state_dict"):
        raise TypeError(f"{what} is a {type(obj).__name__} without state_dict(); pass an object with "
                        "state_dict()/load_state_dict() (e.g. zeroshard.data.ResumableSampler)")
    return jsontree.encode(obj.state_dict(), what)


def _hf_config(model: Optional[nn.Module]) -> Optional[dict]:
    """A Hugging Face model's config, so ``export_hf`` can write ``config.json`` beside the
    weights and the export loads with ``from_pretrained`` on its own."""
    config = getattr(model, "config", None)
    to_dict = getattr(config, "to_dict", None)
    if not callable(to_dict):
        return None
    try:
        return json.loads(json.dumps(to_dict(), default=str))
    except (TypeError, ValueError):
        return None


def full_names(model: Optional[nn.Module], opt: Optional["ZeroOptimizer"], save_frozen: bool) -> list[str]:
    return list(full_tensors(model, opt, frozen=save_frozen)[0])


def _capture(step: int, model: Optional[nn.Module], opt: Any, scheduler: Any, dataloader: Any,
             extra: Any, world_size: int, save_frozen: bool = False, writes_full: bool = True,
             residuals: Optional[dict[str, torch.Tensor]] = None) -> commit.Snapshot:
    records: list[PieceRecord] = owned_pieces(model, opt) if opt is not None else []
    if save_frozen:
        records += frozen_base.frozen_pieces(opt)
    for rec in records:  # scalars (e.g. Adam's step) change in place: encode them now
        rec.scalars = {k: jsontree.encode(v, f"optimizer state {k!r}") for k, v in rec.scalars.items()}
    # Every rank walks the model state (should a stage hook state_dict() with a collective,
    # all ranks take part); rank 0 alone writes the unsharded tensors.
    full, aliases = full_tensors(model, opt, frozen=save_frozen)
    base = frozen_base.base_record(model, opt, save_frozen)  # (a collective at stage 3)
    if not save_frozen:  # a tied frozen weight is recorded under its first name only
        aliases = {k: v for k, v in aliases.items() if v not in base["tensors"]}
    if not writes_full:  # (rank 0; under pp each stage's first rank: Note [pipeline checkpoints])
        full = {}
    snap = commit.Snapshot(step, records, full, rng.capture(), _encode_state(dataloader, "dataloader"),
                           own=codec_residuals.residual_tensors(opt) if residuals is None else residuals)
    # Every rank builds and checks the header (cheap, and all refuse alike); rank 0 writes it.
    names = name_map(model, opt) if opt is not None else {}
    groups = [{**{k: v for k, v in g.items() if k not in ("params", "optimizer_class")},  # (a class: the loader's own;
               # frozen parameters train in no group)
               "params": [names[opt.engine.param_names[id(p)]] for p in g["params"] if p.requires_grad]}
              for g in opt.param_groups] if opt is not None else []
    snap.header = {
        "format": manifest.FORMAT, "version": manifest.VERSION, "step": step,
        "world_size": world_size,
        "stage": opt.stage if opt is not None else 0,
        "mixed_precision": opt.engine.config.mixed_precision if opt is not None else None,
        "optimizer": type(opt.engine.joined().inner).__name__ if opt is not None else None,
        "param_groups": jsontree.encode(groups, "param_groups"),
        "aliases": aliases,
        "model_config": _hf_config(model),
        "trainer": {"scheduler": _encode_state(scheduler, "scheduler"),
                    "loss_scaler": opt.engine.scaler.state_dict() if opt is not None and opt.engine.scaler else None,
                    "extra": jsontree.encode(extra, "extra")},
    }
    if base["tensors"]:  # Note [frozen weights in checkpoints]
        snap.header["frozen"] = base
    try:
        validate.check_header(snap.header, f"step {step}")
    except CheckpointCorruptError as exc:
        raise ValueError(f"refusing to save {exc}: load_checkpoint would refuse it") from None
    return snap  # (the header is rank 0's to write: the others drop it once merged)


def _check_arguments(root: Any, step: Any, keep_last: Any, async_save: Any) -> str:
    """The save's own arguments, refused by name (the step with the loader's range)."""
    if not isinstance(root, (str, os.PathLike)):
        raise TypeError(f"root={root!r}: a checkpoint root must be a path (str or os.PathLike)")
    reason = validate.step_value(step)
    if reason is not None:
        raise ValueError(reason)
    if keep_last is not None and (not validate.is_int(keep_last) or keep_last < 1):
        raise ValueError(f"keep_last={keep_last!r}: keep at least 1 checkpoint (an int, or None to keep all)")
    if not isinstance(async_save, bool):
        raise TypeError(f"async_save={async_save!r} must be True or False")
    return os.fspath(root)


def _shapes(model: Optional[nn.Module], opt: Any, save_frozen: bool = False) -> dict[str, dict]:
    out = {}
    if opt is not None:
        names = name_map(model, opt)
        engine = opt.engine.joined()
        tp = engine.tp
        for u in engine.units:
            for seg in u.layout.segments:
                out[names[seg.name]] = {"shape": list(seg.shape), "dtype": CODES[u.flat.dtype],
                                        "group": seg.group, "kind": "sharded"}
                if seg.complex_dtype is not None:  # (stored as its reals: Note [complex parameters])
                    out[names[seg.name]]["complex_dtype"] = COMPLEX_CODES[seg.complex_dtype]
                if tp is not None:  # the global tensor, and how tp splits it (Note [stored order])
                    out[names[seg.name]]["shape"] = list(tp.global_shape(seg.name, seg.shape))
                    if tp.split_of(seg.name) is not None:
                        out[names[seg.name]]["split"] = tp.split_of(seg.name)[0].manifest()
        if save_frozen:
            for u, seg in frozen_base.unit_segments(opt):
                out[seg.name] = {"shape": list(seg.shape), "dtype": CODES[u.flat.dtype], "group": None,
                                 "kind": "frozen"}
    if model is not None:
        held = model.state_dict(keep_vars=True)
        for n, t in full_tensors(model, opt, frozen=save_frozen)[0].items():
            out[n] = {"shape": list(t.shape), "dtype": CODES[t.dtype], "group": None, "kind": "full"}
            if held[n].is_complex():  # (stored as its reals, like a trained one: Note [complex parameters])
                out[n]["complex_dtype"] = COMPLEX_CODES[held[n].dtype]
    return out


_SAVER = CheckpointSaver()


def checkpoint_comm(opt: Optional["ZeroOptimizer"]) -> Comm:
    """The ranks that write (and load) ``opt``'s checkpoints, on the savers' side group."""
    return _SAVER._comm(opt)


def forget_side_groups() -> None:
    """Drops the cached save side groups (``checkpoint_comm``): their world was destroyed (an
    in-process recovery re-forms the group, Note [in-process recovery] in
    zeroshard/train/in_process.py). Kept, they would hold the old group's connections open (a
    live peer waiting on this rank in a save would not fail until its timeout)."""
    _SAVER._comms.clear()


def wait_checkpoint() -> None:
    """Waits for this process's in-flight save (raising if it failed) and for the deletion of
    the steps it rotated out (Note [deleting in the background] in commit.py)."""
    _SAVER.wait()
    commit.wait_discarded()


def save_checkpoint(root: str, step: int, *, model: Optional[nn.Module], optimizer: Any,
                    scheduler: Any = None, dataloader: Any = None, extra: Any = None,
                    async_save: bool = False, keep_last: Optional[int] = None,
                    save_frozen: Optional[bool] = None) -> PendingSave:
    """Saves the full training state as ``root/step-NNNNNNNN`` (a collective: every rank of
    the optimizer's process group calls it). Each rank writes only the pieces it owns. With
    ``async_save=True`` it returns once the small state is captured; ``.wait()`` on the
    returned handle (or ``zeroshard.wait_checkpoint()``) blocks until committed.

    Frozen parameters (``requires_grad=False``) are written, except a PEFT model's base: that
    is recorded by name, shape and digest, and resuming checks the base matches;
    ``save_frozen=True``/``False`` writes them or not whatever the model (Note [frozen weights
    in checkpoints] in zeroshard/checkpoint/frozen_base.py)."""
    if model is None and optimizer is None:
        raise ValueError("save_checkpoint needs model=... and/or optimizer=... (with neither it would save "
                         "nothing): pass the model and its ZeroOptimizer")
    if save_frozen is None:
        save_frozen = frozen_base.save_frozen_default(model, optimizer)
    if not isinstance(save_frozen, bool):
        raise TypeError(f"save_frozen={save_frozen!r} must be True, False or None (whole unless a PEFT model)")
    return _SAVER.save(root, step, model, optimizer, scheduler, dataloader, extra, async_save, keep_last,
                       save_frozen=save_frozen)

