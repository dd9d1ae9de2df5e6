"""Loading a torch Distributed Checkpoint (DCP) into a model and ZeroOptimizer.

``load_checkpoint`` hands a directory holding a DCP ``.metadata`` here (Note [DCP format
mapping]). The phases are the native loader's: every rank reads and checks all it needs (the
chunks overlapping its owned pieces, nothing else), the ranks agree, then the small state
and the tensors are applied. Nothing of a checkpoint that fails a check reaches the model.
"""
from __future__ import annotations

import json
import math
import os
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn
from torch.distributed.checkpoint import metadata as md
from torch.distributed.checkpoint._nested_dict import unflatten_state_dict
from torch.distributed.checkpoint.filesystem import _StorageInfo

from zeroshard.checkpoint import dcp_metadata, jsontree, rng, stage_merge
from zeroshard.checkpoint.checkpoint_errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError
from zeroshard.checkpoint.load import _held, _needed, write_param
from zeroshard.checkpoint.pieces import name_map
from zeroshard.offload.unit_swap import resident_runs
from zeroshard.optim.interrupts import state_restored
from zeroshard.optim.state_io import apply_group_options, check_kinds, fill_run, normalize_loaded
from zeroshard.optim.registry import optimizer_for

if TYPE_CHECKING:
    from zeroshard.checkpoint.dcp_metadata import Stateful
    from zeroshard.comm import Comm
    from zeroshard.optim.zero_optimizer import ZeroOptimizer


SECTIONS = ("optimizer", "lr_scheduler", "dataloader", "train_state")
"""torchtitan's top-level entries besides the model's (whose keys may be top-level too)."""
IMPLEMENTATION_OPTIONS = frozenset({"foreach", "fused", "capturable", "differentiable"})
"""Param-group options that pick a kernel, not a value: the loading optimizer keeps its own."""


class DcpSource:
    """One DCP checkpoint: its checked metadata and the chunks this rank has read."""

    def __init__(self, directory: str, keep_chunks: bool = True) -> None:
        self.dir = directory
        self.keep_chunks = keep_chunks  # False: each chunk is read again when needed (a streamed conversion)
        self.meta = dcp_metadata.read_metadata(directory)
        self.entries = self.meta.state_dict_metadata
        self.where: dict[tuple[str, tuple[int, ...]], _StorageInfo] = {
            (i.fqn, tuple(i.offset) if i.offset is not None else ()): info for i, info in self.meta.storage_data.items()}
        self.model_prefix = "model." if any(k.startswith("model.") for k in self.entries) else ""
        self._chunks: dict[tuple[str, int], torch.Tensor] = {}
        self.bytes_read = 0

    def model_names(self) -> dict[str, md.TensorStorageMetadata]:
        """Model tensors by their ``state_dict`` name."""
        n = len(self.model_prefix)
        return {k[n:]: e for k, e in self.entries.items() if isinstance(e, md.TensorStorageMetadata) and (
            k.startswith(self.model_prefix) if n else not k.startswith(tuple(s + "." for s in SECTIONS)))}

    def _blob(self, key: str, offsets: tuple[int, ...]) -> object:
        info = self.where.get((key, offsets))
        if info is None:
            raise CheckpointCorruptError(f"{self.dir}: the metadata lists chunk {list(offsets)} of {key!r} but no "
                                         "storage entry for it; the checkpoint is incomplete")
        what = f"{self.dir}: {key!r} chunk at {list(offsets)}"
        data = dcp_metadata.read_range(self.dir, info, what)
        self.bytes_read += len(data)
        return dcp_metadata.load_blob(data, what)

    def tensor(self, key: str) -> md.TensorStorageMetadata:
        entry = self.entries[key]
        if not isinstance(entry, md.TensorStorageMetadata):
            raise CheckpointCorruptError(f"{self.dir}: {key!r} is a bytes entry where a tensor is expected")
        return entry

    def _chunk(self, key: str, i: int) -> torch.Tensor:
        if (key, i) not in self._chunks:
            entry = self.tensor(key)
            c = entry.chunks[i]
            t = self._blob(key, tuple(c.offsets))
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(c.sizes) or t.dtype != entry.properties.dtype:
                got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise CheckpointCorruptError(f"{self.dir}: {key!r} chunk at {list(c.offsets)} holds {got}, the "
                                             f"metadata says {entry.properties.dtype} {list(c.sizes)}")
            if not self.keep_chunks:
                return t
            self._chunks[(key, i)] = t
        return self._chunks[(key, i)]

    def flat_range(self, key: str, a: int, b: int) -> torch.Tensor:
        """Elements ``[a, b)`` of tensor ``key`` in row-major order, read from the chunks that
        hold its rows ``[a // row, ceil(b / row))`` only (Note [DCP format mapping])."""
        entry = self.tensor(key)
        shape = tuple(entry.size)
        if not shape:
            return self._chunk(key, 0).reshape(1)[a:b]
        row = math.prod(shape[1:])
        r0, r1 = a // row, -(-b // row)
        out = torch.empty((r1 - r0,) + shape[1:], dtype=entry.properties.dtype)
        covered = 0
        for i, c in enumerate(entry.chunks):
            lo, hi = max(r0, c.offsets[0]), min(r1, c.offsets[0] + c.sizes[0])
            if lo >= hi or 0 in c.sizes:
                continue
            src = self._chunk(key, i)[lo - c.offsets[0]:hi - c.offsets[0]]
            dst = out[lo - r0:hi - r0]
            for d in range(1, len(shape)):
                dst = dst.narrow(d, c.offsets[d], c.sizes[d])
            dst.copy_(src)
            covered += src.numel()
        if covered != out.numel():
            raise CheckpointCorruptError(f"{self.dir}: the chunks of {key!r} cover {covered} of the "
                                         f"{out.numel()} elements of rows [{r0}, {r1}) (overlapping or missing chunks)")
        return out.reshape(-1)[a - r0 * row:b - r0 * row]

    def value(self, key: str) -> object:
        """A bytes entry's object, or a tensor entry whole."""
        entry = self.entries[key]
        if isinstance(entry, md.BytesStorageMetadata):
            return self._blob(key, ())
        size = self.tensor(key).size
        return self.flat_range(key, 0, math.prod(size)).reshape(size) if size else self._chunk(key, 0).clone()

    def section(self, name: str) -> Optional[dict]:
        """A top-level entry (``lr_scheduler``, ``train_state`` ...) rebuilt as the object saved."""
        keys = [k for k in self.entries if k == name or k.startswith(name + ".")]
        if not keys:
            return None
        mapping = self.meta.planner_data if isinstance(self.meta.planner_data, dict) else {}
        flat = {k: self.value(k) for k in keys}
        paths = {k: mapping.get(k, tuple(k.split(".", 1))) for k in keys}
        if not all(isinstance(p, tuple) and p and p[0] == name for p in paths.values()):
            raise CheckpointCorruptError(f"{self.dir}: the metadata's key paths for {name!r} are malformed")
        return unflatten_state_dict(flat, paths).get(name)


def _optimizer_keys(src: DcpSource) -> dict[str, dict[str, str]]:
    """Parameter name -> state key -> DCP key (``optimizer.state.{fqn}.{k}``)."""
    out: dict[str, dict[str, str]] = {}
    for k in src.entries:
        if k.startswith("optimizer.state."):
            fqn, key = k[len("optimizer.state."):].rsplit(".", 1)
            out.setdefault(fqn, {})[key] = k
    return out


def check_model(src: DcpSource, model: Optional[nn.Module], opt: "Optional[ZeroOptimizer]") -> None:
    """CheckpointMismatchError listing every name and shape that differs."""
    expected = _held(model, opt)[0]
    saved = {n: tuple(e.size) for n, e in src.model_names().items()}
    missing, unexpected = sorted(set(expected) - set(saved)), sorted(set(saved) - set(expected))
    wrong = [f"{n}: checkpoint {list(saved[n])} vs model {list(expected[n][0])}"
             for n in sorted(set(saved) & set(expected)) if saved[n] != tuple(expected[n][0])]
    if missing or unexpected or wrong:
        parts = ([f"missing from the checkpoint: {missing[:10]}"] if missing else []) + \
            ([f"not in the model: {unexpected[:10]}"] if unexpected else []) + \
            (["shape mismatch: " + "; ".join(wrong[:10])] if wrong else [])
        raise CheckpointMismatchError(f"{src.dir} (DCP) was saved from a different model ({' | '.join(parts)}); "
                                      "load it into the model that wrote it")


def saved_groups(src: DcpSource, opt: "ZeroOptimizer", names: dict[str, str]) -> Optional[list[dict]]:
    """The saved options of each of ``opt``'s param groups (from ``param_groups.{fqn}.{k}``), or
    None without optimizer entries; refuses options another optimizer class keeps."""
    per_param: dict[str, dict[str, str]] = {}
    for k in src.entries:
        if k.startswith("optimizer.param_groups."):
            fqn, key = k[len("optimizer.param_groups."):].rsplit(".", 1)
            per_param.setdefault(fqn, {})[key] = k
    if not per_param:
        return None
    groups = []
    for gi, g in enumerate(opt.param_groups):
        mine = [names[opt.engine.param_names[id(p)]] for p in g["params"] if p.requires_grad]
        values = [{k: src.value(key) for k, key in per_param.get(n, {}).items()} for n in mine]
        if any(not v for v in values):
            raise CheckpointMismatchError(f"{src.dir}: no saved param group for "
                                          f"{[n for n, v in zip(mine, values) if not v][:5]}")
        if any(v != values[0] for v in values):
            raise CheckpointMismatchError(f"{src.dir}: the parameters of param group {gi} ({mine[:5]}) were saved "
                                          "with different options; build the groups as the run that saved it did")
        foreign = sorted(set(values[0] if values else {}) - set(g) - {"initial_lr"})
        if foreign:
            raise CheckpointMismatchError(
                f"{src.dir}: param group {gi} was saved with options {foreign} that "
                f"{opt.engine.optimizer_class.__name__} does not take: it was saved by another optimizer class")
        groups.append({k: v for k, v in (values[0] if values else {}).items()
                       if k not in IMPLEMENTATION_OPTIONS and k in g})
    return groups


def load_dcp(path: str, model: Optional[nn.Module], opt: "Optional[ZeroOptimizer]", scheduler: Optional[Stateful],
             dataloader: Optional[Stateful], comm: "Comm", load_rng: bool = True) -> dict:
    """``load_checkpoint`` of a DCP directory (see the module docstring)."""
    error: Optional[tuple[str, str]] = None
    plan = None
    src: Optional[DcpSource] = None
    try:
        if opt is not None and (opt.engine.tp is not None or stage_merge.pipeline_of(opt) is not None):
            raise CheckpointMismatchError("loading a DCP checkpoint under tensor or pipeline parallelism is not "
                                          "supported; load it at plain data parallelism and save natively")
        damage = dcp_metadata.verify(path)
        if damage is not None:
            raise CheckpointCorruptError(damage)
        src = DcpSource(path)
        check_model(src, model, opt)
        plan = _read(src, model, opt, scheduler, dataloader)
        _per_rank(src, plan, dataloader, comm.rank, comm.world_size, load_rng)
    except CheckpointMismatchError as exc:
        error = ("mismatch", str(exc))
    except CheckpointError as exc:
        error = ("corrupt", str(exc))
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:  # (values no check foresaw)
        error = ("corrupt", f"{path}: malformed DCP checkpoint ({type(exc).__name__}: {exc})")
    errors = [e for e in comm.all_gather_object(error) if e]
    if errors:
        mismatch = [m for kind, m in errors if kind == "mismatch"]
        raise CheckpointMismatchError(mismatch[0]) if mismatch else CheckpointCorruptError(errors[0][1])
    if src is None or plan is None:  # (without an error, this rank read it all)
        raise RuntimeError(f"{path}: no rank reported an error, but this rank's read is incomplete")
    _apply(plan, model, opt, scheduler, dataloader)
    if plan["rng"] is not None:  # (last: nothing before draws from the generators)
        rng.restore(plan["rng"])
    train = plan["train_state"] if isinstance(plan["train_state"], dict) else {}
    step = saved_step(train)
    if opt is not None:
        state_restored(opt, step)
    return {"step": step, "path": path, "extra": saved_extra(path, train), "skipped": [], "world_size": None, "stage": None,
            "format": "dcp", "resharded": plan["resharded"], "rng_restored": plan["rng"] is not None,
            "bytes_read": src.bytes_read}


def elementwise(entry: object, shape: tuple[int, ...], kind: str) -> bool:
    """Whether a saved optimizer state is per element of its parameter (of ``shape``): it has the
    parameter's shape; a 1-element parameter's 0-d ``step`` does not, nor a 0-d one's ``step``."""
    return isinstance(entry, md.TensorStorageMetadata) and tuple(entry.size) == tuple(shape) and \
        not (kind == "step" and math.prod(shape) == 1)


def saved_step(train: dict) -> int:
    """``train_state.step`` (an int, or a tensor as some trainers keep it; 0 without one)."""
    step = train.get("step", 0)
    return int(step.item() if isinstance(step, torch.Tensor) else step) if isinstance(step, (int, torch.Tensor)) else 0


def saved_extra(path: str, train: dict) -> object:
    """What a load hands back as ``extra``: a checkpoint zeroshard wrote (its checksum file
    beside .metadata) gives back the ``extra`` it was saved with, as the native format does;
    FSDP2's or torchtitan's own train_state (their counters) comes back whole, less what
    zeroshard reads itself."""
    if os.path.lexists(os.path.join(path, dcp_metadata.CHECKSUMS)):
        return train.get("extra")
    return {k: v for k, v in train.items() if k not in ("rng", "dataloader", "world_size", "step")} or None


def _read(src: DcpSource, model: Optional[nn.Module], opt: "Optional[ZeroOptimizer]", scheduler: Optional[Stateful],
          dataloader: Optional[Stateful]) -> dict:
    """Everything this rank applies, read and checked (phase 1)."""
    saved = set(src.model_names())
    params = {}
    for name, a, b, run, piece, _ in _needed(opt, model, saved):
        if a < b:
            params[(name, a, b)] = (src.flat_range(src.model_prefix + name, a, b), run, piece)
    state: dict[tuple[str, int, int, str], object] = {}
    groups = None
    if opt is not None:
        names = name_map(model, opt)
        okeys = _optimizer_keys(src)
        groups = saved_groups(src, opt, names)
        got: dict[str, tuple[dict, Optional[int]]] = {own: ({k: tuple(src.tensor(key).size) if isinstance(src.entries[key], md.TensorStorageMetadata)
                      else Ellipsis for k, key in okeys.get(ck, {}).items()}, None) for own, ck in names.items()}
        try:
            check_kinds(opt, groups or [{} for _ in opt.param_groups], got, src.dir)
        except ValueError as exc:
            raise CheckpointMismatchError(f"{exc} (DCP: another optimizer class)") from None
        for run in opt.engine.runs:
            for p in run.unit.layout.pieces_in(run.a, run.b):
                ck = names[p.segment.name]
                for k, key in okeys.get(ck, {}).items():
                    e = src.entries[key]
                    state[(p.segment.name, p.start, p.stop, k)] = src.value(key) if not elementwise(e, p.segment.shape, k) else \
                        src.flat_range(key, p.start, p.stop)
                if run.unit.separate_master:
                    state[(p.segment.name, p.start, p.stop, "__master__")] = \
                        src.flat_range(src.model_prefix + ck, p.start, p.stop).float()
    return {"params": params, "state": state, "groups": groups,
            "scheduler": src.section("lr_scheduler") if scheduler is not None else None,
            "dataloader": src.section("dataloader") if dataloader is not None else None,
            "train_state": src.section("train_state")}


def _per_rank(src: DcpSource, plan: dict, dataloader: Optional[Stateful], rank: int, world: int,
              load_rng: bool) -> None:
    """The RNG state and data position zeroshard saved per rank (``train_state.rng.rank{r}``,
    ``train_state.dataloader.rank{r}``, JSON): every saved RNG state is checked; this rank's
    are applied when the world size is the saving one (Note [DCP format mapping]). A checkpoint
    FSDP2 wrote has none: the generators are left alone."""
    train = plan["train_state"] if isinstance(plan["train_state"], dict) else {}
    states, loaders = train.get("rng") or {}, train.get("dataloader") or {}
    if not isinstance(states, dict) or not isinstance(loaders, dict):
        raise CheckpointCorruptError(f"{src.dir}: train_state.rng / train_state.dataloader are not per-rank entries")
    saved_world = train.get("world_size", len(states) or None)
    same = saved_world == world and bool(states)
    plan["resharded"], plan["rng"] = not same, None
    for key, text in states.items():
        where = f"{src.dir}: train_state.rng.{key}"
        if not isinstance(text, str):
            raise CheckpointCorruptError(f"{where} is not a JSON string")
        checked = rng.check(json.loads(text), where)
        if same and load_rng and key == f"rank{rank}":
            plan["rng"] = checked
    mine = loaders.get(f"rank{rank}")
    if dataloader is not None and same and mine is not None:
        if not isinstance(mine, str):
            raise CheckpointCorruptError(f"{src.dir}: train_state.dataloader.rank{rank} is not a JSON string")
        plan["dataloader"] = jsontree.decode(json.loads(mine), f"{src.dir}: train_state.dataloader.rank{rank}")


def _apply(plan: dict, model: Optional[nn.Module], opt: "Optional[ZeroOptimizer]", scheduler: Optional[Stateful],
           dataloader: Optional[Stateful]) -> None:
    if opt is not None and plan["groups"] is not None:
        apply_group_options(opt, plan["groups"])
    if scheduler is not None and plan["scheduler"] is not None:
        scheduler.load_state_dict(plan["scheduler"])
    if dataloader is not None and plan["dataloader"] is not None:
        dataloader.load_state_dict(plan["dataloader"])
    state_dict = model.state_dict(keep_vars=True) if model is not None else {}
    with torch.no_grad():
        for (name, _, _), (values, run, piece) in plan["params"].items():
            write_param(state_dict, name, values, run, piece)
        if opt is None:
            managed = optimizer_for(model) if model is not None else None
            if managed is not None:
                managed.engine.weights_changed()
            return
        state = plan["state"]
        keys = sorted({k[3] for k in state if k[3] != "__master__"})
        for unit in opt.engine.units:
            unit.needs_init = False
        for run in resident_runs(opt.engine.runs, write=True):
            fill_run(opt, run, keys, lambda own, a, b, key: state.get((own, a, b, key)))
    normalize_loaded(opt)
    opt.gather_params()
