"""``get_state_dict`` / ``set_state_dict`` for a ZeroOptimizer, zeroshard's own: the flattened
keys of torch's ``get_state_dict(..., StateDictOptions(flatten_optimizer_state_dict=True))``
with the fp32 masters as the model's entries (torch's own functions, which also take a
ZeroOptimizer, give the model's own tensors: Note [torch's get_state_dict on a ZeroOptimizer]).
Each trained tensor and its state is a ``ShardedTensor`` of this rank's boxes as *views* of the
live tensors, so ``dcp.save`` writes them and ``dcp.load`` reads the overlapping chunks of any
DCP checkpoint (FSDP2's included) straight into them; ``set_state_dict`` then applies the
options and makes the full parameters current.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor

from zeroshard.checkpoint.pieces import full_tensors, name_map
from zeroshard.checkpoint.torch_state_dict import SKIP, init_state, refuse_unviewable, sharded_views
from zeroshard.offload.unit_swap import resident_runs
from zeroshard.optim.state_io import apply_group_options, normalize_loaded

if TYPE_CHECKING:
    from zeroshard.optim.zero_optimizer import ZeroOptimizer


def _one(optimizers: object) -> "ZeroOptimizer":
    opts = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    if len(opts) != 1 or not hasattr(opts[0], "engine"):
        raise TypeError(f"zeroshard's get_state_dict/set_state_dict take one ZeroOptimizer; got {optimizers!r}")
    return opts[0]  # type: ignore[return-value]


def get_state_dict(model: nn.Module, optimizers: object) -> tuple[dict[str, object], dict[str, object]]:
    """(model state dict, flattened optimizer state dict) in the keys of torch's
    ``get_state_dict(..., StateDictOptions(flatten_optimizer_state_dict=True))``: a collective."""
    opt = _one(optimizers)
    refuse_unviewable(opt, "zeroshard's get_state_dict")
    init_state(opt)
    names = name_map(model, opt)
    tensors, scalars = sharded_views(opt, model)
    msd: dict[str, object] = {}
    osd: dict[str, object] = {}
    for name, kinds in tensors.items():
        for kind, st in kinds.items():
            if kind:
                osd[f"state.{name}.{kind}"] = st
            else:
                msd[name] = st
    for name, per in scalars.items():
        for k, v in per.items():
            osd[f"state.{name}.{k}"] = v if isinstance(v, torch.Tensor) else torch.tensor(float(v))
    for name, t in full_tensors(model, opt)[0].items():
        msd[name] = t
    for g in opt.param_groups:
        known = _class_options(g.get("optimizer_class", opt.engine.optimizer_class))
        for p in g["params"]:
            if p.requires_grad:
                for k, v in g.items():
                    if k not in SKIP and (known is None or k in known):
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
            saved = {k: optim_state_dict[f"param_groups.{first}.{k}"] for k in g if k not in SKIP and
                     f"param_groups.{first}.{k}" in optim_state_dict}
            groups.append({k: v for k, v in saved.items() if k not in ("foreach", "fused", "capturable", "differentiable")})
        apply_group_options(opt, groups)
    normalize_loaded(opt)
    opt.gather_params()
