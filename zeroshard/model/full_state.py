"""``full_state_dict(model)``: an ordinary, unsharded state dict of a zeroshard model."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from zeroshard.comm.tensor_parallel import is_dtensor
from zeroshard.optim.registry import optimizer_for
from zeroshard.stages.stage3.unit_state import UnitState


@torch.no_grad()
def full_state_dict(model: nn.Module, rank0_only: bool = True, cpu: bool = True,
                    frozen: bool = True) -> Optional[dict]:
    """Gathers every parameter whole, one unit at a time (peak: one unit beyond what the rank
    holds). A collective: every rank must call it. With ``rank0_only`` the other ranks get
    None and keep nothing. Keys and tied entries are those of ``model.state_dict()``;
    ``frozen=False`` leaves out frozen parameters (a LoRA base: only the adapters are gathered)."""
    opt = optimizer_for(model)
    live = model.state_dict(keep_vars=True)
    if not frozen:
        live = {k: v for k, v in live.items() if not (isinstance(v, nn.Parameter) and not v.requires_grad)}
    if opt is None or not opt.engine.shards_parameters:  # stages 0-2: every rank holds full parameters
        live = {k: v.full_tensor().detach() if is_dtensor(v) else v for k, v in live.items()}  # (TP: global)
        out = {k: (v.detach().cpu() if cpu else v.detach()).clone() for k, v in live.items()}
        return None if rank0_only and (opt is not None and opt.engine.comm.rank != 0) else out
    gatherer = opt.engine.stage3_gatherer
    keep = not rank0_only or opt.engine.comm.rank == 0
    where = opt.engine.segment_index()
    by_unit: dict[int, list[str]] = {}
    out = {}  # (dict[str, torch.Tensor], as above)
    for key, t in live.items():
        if id(t) in where:
            by_unit.setdefault(where[id(t)][0].layout.index, []).append(key)
        elif keep:
            out[key] = (t.detach().cpu() if cpu else t.detach()).clone()
    for ui, unit in enumerate(opt.engine.joined().all_units):
        if unit.frozen and not frozen:
            continue
        was_released = gatherer.state[ui] is UnitState.RELEASED
        gatherer.ensure_exact(ui)
        if keep:  # read the gathered buffer: live[key] is the sharded parameter shown between uses
            for key in by_unit.get(unit.layout.index, []):
                seg = where[id(live[key])][1]
                t = seg.bind(unit.flat[seg.offset:seg.end])
                t = opt.engine.tp.full(seg.name, t) if opt.engine.tp is not None else t  # (a TP shard: the global tensor)
                out[key] = (t.cpu() if cpu else t).clone()
        if was_released:
            gatherer.release(ui)
    return {k: out[k] for k in live if k in out} if keep else None
