"""A ZeroOptimizer's state in the form torch's distributed state-dict API works on.

``torch.distributed.checkpoint.state_dict.get_state_dict(model, opt)`` reads
``opt.state_dict()`` as a plain optimizer's: ``{"state": {pid: {key: tensor}}, "param_groups":
[{..., "params": [pid]}]}`` with each state tensor in its parameter's (local or distributed)
shape, and ``set_state_dict`` hands back the same structure keyed by FQN. A ZeroOptimizer keeps
its state on flat partitions that straddle parameters, which no DTensor placement describes, so
each parameter's state goes out as a ``ShardedTensor`` whose local shards are this rank's boxes
(``layout/boxes.py``) as *views* of the live tensors: ``dcp.save`` writes them and ``dcp.load``
reads the overlapping chunks of any DCP checkpoint (FSDP2's included) straight into them.

Note [torch's get_state_dict on a ZeroOptimizer]:
``opt.state_dict()`` stays the sharded, picklable form everyone else gets (``torch.save`` by
the HF Trainer, Lightning, Accelerate: a ShardedTensor would neither survive ``weights_only``
loading nor pair with another process group). torch offers no hook by which its state-dict API
could ask for another form, so ``state_dict()`` hands out this one only when its caller is
torch's ``_get_optim_state_dict`` (``asked_by_torch``: the caller's code object, not its name).
A torch that renames that function gets the sharded form and fails in its own key mapping,
which ``tests/checkpoint/test_dcp_read.py`` catches. ``load_state_dict`` needs no such test:
a dict keyed by FQN strings is this form (torch.optim's own is keyed by index).
"""
from __future__ import annotations

import sys
from types import FrameType
from typing import TYPE_CHECKING, Optional, Union, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

from zeroshard.layout.boxes import boxes
from zeroshard.checkpoint.pieces import MASTER, PARAM, name_map, owned_pieces
from zeroshard.checkpoint.shard_file import Deferred
from zeroshard.offload.unit_swap import resident_runs
from zeroshard.optim.state_io import apply_group_options, fill_run, normalize_loaded
from zeroshard.optim.state_forms import StateForm, register
from zeroshard.optim.state_kinds import expected_state

if TYPE_CHECKING:
    from zeroshard.optim.zero_optimizer import ZeroOptimizer

SKIP = ("params", "optimizer_class")
# (offsets, sizes, flat lo, flat hi, the live view) of one box of one tensor on this rank
Scalar = Union[torch.Tensor, float, int]
LocalBox = tuple[tuple[int, ...], tuple[int, ...], int, int, torch.Tensor]


def asked_by_torch(caller: FrameType) -> bool:
    """Whether ``state_dict()``'s caller is torch's ``_get_optim_state_dict``
    (Note [torch's get_state_dict on a ZeroOptimizer])."""
    module = sys.modules.get("torch.distributed.checkpoint.state_dict")
    fn = getattr(module, "_get_optim_state_dict", None)
    code = getattr(getattr(fn, "__wrapped__", fn), "__code__", None)
    return code is not None and caller.f_code is code


def init_state(opt: "ZeroOptimizer") -> None:
    """State to load into before the first step: zeros of what the class keeps (what torch's
    ``get_state_dict`` gets by a zero-lr step), allocated where the run keeps its state."""
    engine = opt.engine
    for run in resident_runs(engine.runs, write=True):
        if engine.inner.state.get(run.tensor):
            continue
        names = {s.segment.name for s in run.unit.layout.pieces_in(run.a, run.b)}
        group = next(g for g in opt.param_groups if any(engine.param_names[id(p)] in names for p in g["params"]))
        cls = group.get("optimizer_class", engine.optimizer_class)
        kept = expected_state(cls, {k: v for k, v in group.items() if k not in SKIP}, (2, 3)) or {}
        fill_run(opt, run, sorted(kept), lambda own, a, b, key: torch.zeros((), dtype=torch.float32)
                 if kept[key] == () else torch.zeros(b - a, dtype=run.tensor.dtype))


def refuse_unviewable(opt: "ZeroOptimizer", api: str) -> None:
    e = opt.engine
    if e.tp is not None or e.swapper is not None or e.unit_store is not None:
        raise ValueError(f"{api} hands out views of the optimizer state in memory; state in swap files (NVMe "
                         "offload) or under tensor parallelism is saved with zeroshard.save_checkpoint(format='dcp')")


def local_boxes(opt: "ZeroOptimizer", model: Optional[nn.Module] = None
                ) -> tuple[dict[str, dict[str, list[LocalBox]]], dict[str, dict[str, Scalar]], dict[str, tuple[int, ...]]]:
    """This rank's boxes per checkpoint name and kind (``""``: the parameter or its master, else
    a state key), its scalar state per name, and every managed tensor's shape. Not a collective."""
    names = name_map(model, opt)
    shapes = {names[seg.name]: tuple(seg.shape) for u in opt.engine.units for seg in u.layout.segments
              if seg.name in names}
    views: dict[str, dict[str, list[LocalBox]]] = {}
    scalars: dict[str, dict[str, Scalar]] = {}
    for rec in owned_pieces(model, opt):
        parts = {"": rec.tensors.get(MASTER, rec.tensors[PARAM])}
        parts.update({k[6:]: t for k, t in rec.tensors.items() if k.startswith("state.")})
        for kind, flat in parts.items():
            if isinstance(flat, Deferred):
                raise ValueError(f"{rec.name} ({kind or 'weights'}): in a swap file; "
                                 "save with zeroshard.save_checkpoint(format='dcp')")
            for offsets, sizes, lo, hi in boxes(shapes[rec.name], rec.start, rec.stop):
                views.setdefault(rec.name, {}).setdefault(kind, []).append(
                    (offsets, sizes, lo, hi, flat[lo - rec.start:hi - rec.start].view(sizes)))
        scalars.setdefault(rec.name, {}).update(rec.scalars)
    return views, scalars, shapes


def sharded_views(opt: "ZeroOptimizer", model: Optional[nn.Module] = None
                  ) -> tuple[dict[str, dict[str, ShardedTensor]], dict[str, dict[str, Scalar]]]:
    """Every trained tensor (kind ``""``) and its state as ShardedTensors of this rank's live
    views, the same names and kinds on every rank; and this rank's scalar state. A collective."""
    views, scalars, shapes = local_boxes(opt, model)
    mine = {(name, kind): [(b[0], b[1]) for b in per] for name, kinds in views.items() for kind, per in kinds.items()}
    dtypes = {(name, kind): per[0][4].dtype for name, kinds in views.items() for kind, per in kinds.items()}
    comm = opt.engine.comm
    everyone = comm.all_gather_object((mine, dtypes))
    ranks = [dist.get_global_rank(comm.group, r) if comm.group is not None and dist.is_initialized() else r
             for r in range(comm.world_size)]
    out: dict[str, dict[str, ShardedTensor]] = {}
    for key in sorted({k for per, _ in everyone for k in per}):
        name, kind = key
        dtype = next(d[key] for _, d in everyone if key in d)
        meta = ShardedTensorMetadata(
            shards_metadata=[ShardMetadata(list(o), list(s), f"rank:{ranks[r]}/cpu")
                             for r, (per, _) in enumerate(everyone) for o, s in per.get(key, [])],
            size=torch.Size(shapes[name]), tensor_properties=TensorProperties(dtype=dtype))
        shards = [Shard(t, ShardMetadata(list(o), list(s), f"rank:{ranks[comm.rank]}/cpu"))
                  for o, s, _, _, t in views.get(name, {}).get(kind, [])]
        out.setdefault(name, {})[kind] = ShardedTensor._init_from_local_shards_and_global_metadata(
            shards, meta, process_group=comm.group)
    return out, scalars


def _pids(opt: "ZeroOptimizer") -> dict[str, int]:
    """Optimizer parameter name -> its index in ``param_groups`` order (torch's pid)."""
    order = [p for g in opt.param_groups for p in g["params"]]
    return {opt.engine.param_names[id(p)]: i for i, p in enumerate(order)}


def state_dict_for_torch(opt: "ZeroOptimizer") -> dict:
    """``{"state": {pid: {key: ShardedTensor | step}}, "param_groups": [...]}`` (module doc)."""
    refuse_unviewable(opt, "torch's get_state_dict on a ZeroOptimizer")
    init_state(opt)
    tensors, scalars = sharded_views(opt)
    pids = _pids(opt)
    state: dict[int, dict[str, object]] = {}
    for name, kinds in tensors.items():
        per: dict[str, object] = {k: v for k, v in kinds.items() if k}
        per.update({k: v if isinstance(v, torch.Tensor) else torch.tensor(float(v))
                    for k, v in scalars.get(name, {}).items()})
        if per:
            state[pids[name]] = per
    groups = [{**{k: v for k, v in g.items() if k not in SKIP}, "params": [pids[opt.engine.param_names[id(p)]]
                                                                         for p in g["params"]]}
              for g in opt.param_groups]
    return {"state": state, "param_groups": groups}


def is_fqn_keyed(state_dict: dict) -> bool:
    """torch's state-dict API form: groups list parameters by FQN (torch.optim's by index)."""
    groups = state_dict.get("param_groups")
    return "state" in state_dict and isinstance(groups, list) and any(
        isinstance(g, dict) and g.get("params") and all(isinstance(p, str) for p in g["params"]) for g in groups)


def load_from_torch(opt: "ZeroOptimizer", state_dict: dict) -> None:
    """Loads the form ``set_state_dict`` hands to ``load_state_dict``: FQN-keyed, each state a
    ShardedTensor (this rank's boxes: the views ``state_dict_for_torch`` handed out, or copies of
    the same boxes) or a whole tensor in its parameter's shape, steps as scalars. The groups'
    parameters are in this optimizer's order (torch's API keeps it)."""
    refuse_unviewable(opt, "torch's set_state_dict on a ZeroOptimizer")
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError(f"the state dict has {len(saved_groups)} param groups, this optimizer has "
                         f"{len(opt.param_groups)}: it was made for another model or grouping")
    names: dict[str, str] = {}
    for i, (saved, live) in enumerate(zip(saved_groups, opt.param_groups)):
        if len(saved.get("params", [])) != len(live["params"]):
            raise ValueError(f"param group {i}: the state dict lists {len(saved.get('params', []))} parameters, "
                             f"this optimizer has {len(live['params'])}")
        names.update({fqn: opt.engine.param_names[id(p)] for fqn, p in zip(saved["params"], live["params"])})
    unknown = sorted(set(state_dict["state"]) - set(names))
    if unknown:
        raise ValueError(f"the state dict has state for parameters this optimizer does not hold: {unknown[:8]}")
    init_state(opt)
    views, _, shapes = local_boxes(opt)
    steps: dict[str, dict[str, torch.Tensor]] = {}
    with torch.no_grad():
        for fqn, entry in state_dict["state"].items():
            name = names[fqn]
            for key, value in entry.items():
                mine = views.get(name, {}).get(key)
                if isinstance(value, ShardedTensor):
                    _copy_shards(fqn, key, value, mine or [])
                elif mine is not None:  # a whole tensor in the parameter's shape: this rank's boxes of it
                    if not isinstance(value, torch.Tensor) or tuple(value.shape) != shapes[name]:
                        raise ValueError(f"state.{fqn}.{key}: {type(value).__name__} of shape "
                                         f"{list(getattr(value, 'shape', []))}, the parameter's is {list(shapes[name])}")
                    whole = value.reshape(-1)
                    for _, sizes, lo, hi, view in mine:
                        view.copy_(whole[lo:hi].view(sizes))
                elif isinstance(value, (int, float)) or isinstance(value, torch.Tensor) and value.numel() == 1:
                    steps.setdefault(name, {})[key] = torch.as_tensor(value, dtype=torch.float32).reshape(())
        engine = opt.engine
        for run in resident_runs(engine.runs, write=True):
            state = engine.inner.state.get(run.tensor, {})
            for piece in run.unit.layout.pieces_in(run.a, run.b):
                for key, value in steps.get(piece.segment.name, {}).items():
                    if key in state and not (isinstance(state[key], torch.Tensor) and state[key].numel() > 1):
                        state[key] = value.clone() if isinstance(state[key], torch.Tensor) else value.item()
            if run.unit.separate_master:
                run.unit.write_back()
        apply_group_options(opt, [{k: v for k, v in g.items() if k not in SKIP} for g in saved_groups])
    normalize_loaded(opt)
    opt.gather_params()


def _copy_shards(fqn: str, key: str, value: ShardedTensor, live: list[LocalBox]) -> None:
    by_box = {(tuple(o), tuple(s)): view for o, s, _, _, view in live}
    for shard in value.local_shards():
        box = (tuple(shard.metadata.shard_offsets), tuple(shard.metadata.shard_sizes))
        view = by_box.pop(box, None)
        if view is None:
            raise ValueError(f"state.{fqn}.{key}: a shard at offsets {list(box[0])} sizes {list(box[1])} is not one "
                             "of this rank's pieces: the state dict was made by an optimizer sharded otherwise "
                             "(take it from get_state_dict on this optimizer)")
        if shard.tensor.data_ptr() != view.data_ptr():
            view.copy_(shard.tensor.view(view.shape))
    if by_box:
        raise ValueError(f"state.{fqn}.{key}: this rank's pieces {sorted(by_box)[:4]} are missing from the state "
                         "dict's shards")


register(StateForm("torch.distributed.checkpoint.state_dict", asked_by_torch,
                   lambda opt: state_dict_for_torch(cast("ZeroOptimizer", opt)), is_fqn_keyed,
                   lambda opt, sd: load_from_torch(cast("ZeroOptimizer", opt), sd)))
