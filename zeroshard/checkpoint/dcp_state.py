"""``get_state_dict`` / ``set_state_dict`` for a ZeroOptimizer: torchtitan-style code that
checkpoints with ``dcp.save`` / ``dcp.load`` runs unchanged but for the import.

torch's own ``torch.distributed.checkpoint.state_dict.get_state_dict(model, opt)`` cannot take
a ZeroOptimizer: it reads ``opt.state_dict()["state"]`` keyed by parameter index with each
state tensor of its parameter's (local or DTensor) shape, whereas a ZeroOptimizer keeps its
state on flat partitions that straddle parameters, which no DTensor placement describes
(and its ``state_dict()`` is the sharded form keyed by name and range). The drop-in here
returns the same keys (model ``fqn``, ``state.{fqn}.{key}``, ``param_groups.{fqn}.{option}``)
with each trained parameter and its state as a ``ShardedTensor`` whose local shards are this
rank's boxes (``dcp_write.boxes``) as *views* of the live tensors: ``dcp.save`` writes them
and ``dcp.load`` reads the overlapping chunks of any DCP checkpoint (FSDP2's included)
straight into them, with torch's default planners; ``set_state_dict`` then applies the options
and makes the full parameters current.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

from zeroshard.checkpoint.dcp_write import boxes
from zeroshard.checkpoint.pieces import MASTER, PARAM, full_tensors, name_map, owned_pieces
from zeroshard.checkpoint.shard_file import Deferred
from zeroshard.offload.unit_swap import resident_runs
from zeroshard.optim.state_io import apply_group_options, fill_run, normalize_loaded
from zeroshard.optim.state_kinds import expected_state

if TYPE_CHECKING:
    from zeroshard.optim.zero_optimizer import ZeroOptimizer

_SKIP = ("params", "optimizer_class")


def _one(optimizers: object) -> "ZeroOptimizer":
    opts = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    if len(opts) != 1 or not hasattr(opts[0], "engine"):
        raise TypeError(f"zeroshard's get_state_dict/set_state_dict take one ZeroOptimizer; got {optimizers!r}")
    return opts[0]  # type: ignore[return-value]


def _init_state(opt: "ZeroOptimizer") -> None:
    """State to load into before the first step: zeros of what the class keeps (what torch's
    ``get_state_dict`` gets by a zero-lr step), allocated where the run keeps its state."""
    engine = opt.engine
    for run in resident_runs(engine.runs, write=True):
        if engine.inner.state.get(run.tensor):
            continue
        group = next(g for g in opt.param_groups if any(engine.param_names[id(p)] in
                                                        {s.segment.name for s in run.unit.layout.pieces_in(run.a, run.b)}
                                                        for p in g["params"]))
        cls = group.get("optimizer_class", engine.optimizer_class)
        kept = expected_state(cls, {k: v for k, v in group.items() if k not in _SKIP}, (2, 3)) or {}
        fill_run(opt, run, sorted(kept), lambda own, a, b, key: torch.zeros((), dtype=torch.float32)
                 if kept[key] == () else torch.zeros(b - a, dtype=run.tensor.dtype))


def get_state_dict(model: nn.Module, optimizers: object) -> tuple[dict[str, object], dict[str, object]]:
    """(model state dict, flattened optimizer state dict) in the keys of torch's
    ``get_state_dict(..., StateDictOptions(flatten_optimizer_state_dict=True))``: a collective."""
    opt = _one(optimizers)
    if opt.engine.tp is not None or opt.engine.swapper is not None or opt.engine.unit_store is not None:
        raise ValueError("zeroshard's get_state_dict hands out views of the state in memory; state in swap files "
                         "or under tensor parallelism is saved with zeroshard.save_checkpoint(format='dcp')")
    _init_state(opt)
    names = name_map(model, opt)
    shapes = {names[seg.name]: tuple(seg.shape) for u in opt.engine.units for seg in u.layout.segments}
    local: dict[str, list[tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]]] = {}
    dtypes: dict[str, torch.dtype] = {}
    msd: dict[str, object] = {}
    osd: dict[str, object] = {}
    for rec in owned_pieces(model, opt):
        parts = {rec.name: rec.tensors.get(MASTER, rec.tensors[PARAM])}
        parts.update({f"state.{rec.name}.{k[6:]}": t for k, t in rec.tensors.items() if k.startswith("state.")})
        for key, flat in parts.items():
            if isinstance(flat, Deferred):
                raise ValueError(f"{key}: in a swap file; save with zeroshard.save_checkpoint(format='dcp')")
            dtypes[key] = flat.dtype
            for offsets, sizes, lo, hi in boxes(shapes[rec.name], rec.start, rec.stop):
                local.setdefault(key, []).append((offsets, sizes, flat[lo - rec.start:hi - rec.start].view(sizes)))
        for k, v in rec.scalars.items():
            osd[f"state.{rec.name}.{k}"] = v if isinstance(v, torch.Tensor) else torch.tensor(float(v))
    comm = opt.engine.comm
    mine = {k: [(o, s) for o, s, _ in v] for k, v in local.items()}
    everyone = comm.all_gather_object(mine)
    ranks = [dist.get_global_rank(comm.group, r) if comm.group is not None and dist.is_initialized() else r
             for r in range(comm.world_size)]
    keys = sorted({k for per in everyone for k in per})
    for key in keys:
        fqn = key.rsplit(".", 1)[0][len("state."):] if key.startswith("state.") else key
        meta = ShardedTensorMetadata(
            shards_metadata=[ShardMetadata(list(o), list(s), f"rank:{ranks[r]}/cpu")
                             for r, per in enumerate(everyone) for o, s in per.get(key, [])],
            size=torch.Size(shapes[fqn]), tensor_properties=TensorProperties(dtype=dtypes.get(key, torch.float32)))
        shards = [Shard(t, ShardMetadata(list(o), list(s), f"rank:{ranks[comm.rank]}/cpu"))
                  for o, s, t in local.get(key, [])]
        st = ShardedTensor._init_from_local_shards_and_global_metadata(shards, meta, process_group=comm.group)
        (osd if key.startswith("state.") else msd)[key] = st
    for name, t in full_tensors(model, opt)[0].items():
        msd[name] = t
    for g in opt.param_groups:
        known = _class_options(g.get("optimizer_class", opt.engine.optimizer_class))
        for p in g["params"]:
            if p.requires_grad:
                for k, v in g.items():
                    if k not in _SKIP and (known is None or k in known):
                        osd[f"param_groups.{names[opt.engine.param_names[id(p)]]}.{k}"] = v
    return msd, osd


def _class_options(cls: type) -> Optional[set[str]]:
    """The options a plain ``cls`` keeps in a param group (and a scheduler's ``initial_lr``):
    those an FSDP2 checkpoint of the same class holds, not zeroshard's own (``adamw_mode``)."""
    try:
        return set(cls([torch.zeros(1, requires_grad=True)]).defaults) | {"initial_lr"}
    except Exception:  # noqa: BLE001 - a class that needs more to build: every option is handed out
        return None


def set_state_dict(model: nn.Module, optimizers: object, *, model_state_dict: dict[str, object],
                   optim_state_dict: dict[str, object]) -> None:
    """Applies what ``dcp.load`` read into the dicts ``get_state_dict`` returned: the tensors
    are already in place (views); the steps, the param-group options and the full parameters
    follow. A collective."""
    opt = _one(optimizers)
    names = name_map(model, opt)
    engine = opt.engine
    with torch.no_grad():
        live = model.state_dict(keep_vars=True)
        for name, t in model_state_dict.items():
            if isinstance(t, torch.Tensor) and not isinstance(t, ShardedTensor) and name in live and live[name] is not t:
                live[name].copy_(t)
        for run in resident_runs(engine.runs, write=True):
            state = engine.inner.state.get(run.tensor, {})
            for piece in run.unit.layout.pieces_in(run.a, run.b):
                for k, v in list(state.items()):
                    loaded = optim_state_dict.get(f"state.{names[piece.segment.name]}.{k}")
                    if isinstance(loaded, torch.Tensor) and not isinstance(loaded, ShardedTensor) and \
                            loaded is not v and loaded.numel() == 1:
                        state[k] = loaded.clone().reshape(v.shape) if isinstance(v, torch.Tensor) else loaded.item()
            if run.unit.separate_master:
                run.unit.write_back()
        groups = []
        for g in opt.param_groups:
            first = next((names[engine.param_names[id(p)]] for p in g["params"] if p.requires_grad), None)
            saved = {k: optim_state_dict[f"param_groups.{first}.{k}"] for k in g if k not in _SKIP and
                     f"param_groups.{first}.{k}" in optim_state_dict}
            groups.append({k: v for k, v in saved.items() if k not in ("foreach", "fused", "capturable", "differentiable")})
        apply_group_options(opt, groups)
    normalize_loaded(opt)
    opt.gather_params()
