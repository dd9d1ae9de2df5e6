"""What one rank stores: its pieces of every trained parameter, keyed by name and range.

The save side only talks to the optimizer through the owned-piece accessors every stage
provides (``unit.owned``, ``unit.layout.pieces_in``, ``unit.param_range``,
``unit.master_range``, ``opt.runs`` and ``opt.inner.state``); nothing here depends on how a
stage reduces gradients or where the state lives, which is what lets stage 3 and offload
plug in (see docs in ``zeroshard/checkpoint/__init__.py``).

Names are the model's ``state_dict`` names when a model is given (so ``export_hf`` output
matches the model class), else the optimizer's parameter names.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

PARAM, MASTER = "param", "master"


@dataclass
class PieceRecord:
    """Range ``[start, stop)`` of parameter ``name``: its tensors by kind (``param``,
    ``master``, ``state.<key>``) and its scalar optimizer states (e.g. ``step``)."""

    name: str
    start: int
    stop: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    scalars: dict[str, Any] = field(default_factory=dict)

    def key(self, kind: str) -> str:
        return f"{self.name}|{self.start}|{kind}"


def model_names(model: Optional[nn.Module]) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()} if model is not None else {}


def name_map(model: Optional[nn.Module], opt: Any) -> dict[str, str]:
    """Optimizer parameter name -> checkpoint name."""
    by_id = model_names(model)
    out = {}
    for g in opt.param_groups:
        for p in g["params"]:
            own = opt.param_names[id(p)]
            out[own] = by_id.get(id(p), own)
    return out


def write_range(opt: Any, unit: Any) -> tuple[int, int]:
    """The unit range this rank writes: what it owns when state is sharded; at stage 0 every
    rank holds everything, so rank r writes slice r and the write load stays balanced."""
    if opt.policy.shard_optimizer:
        return unit.owned
    return unit.layout.slice_of(opt.comm.rank)


def owned_pieces(model: Optional[nn.Module], opt: Any) -> list[PieceRecord]:
    """This rank's pieces, as views of the live tensors (callers copy before training goes on)."""
    names = name_map(model, opt)
    records = []
    for run in opt.runs:
        wlo, whi = write_range(opt, run.unit)
        lo, hi = max(run.a, wlo), min(run.b, whi)
        if lo >= hi:
            continue
        state = opt.inner.state.get(run.tensor, {})
        for piece in run.unit.layout.pieces_in(lo, hi):
            ua, ub = piece.unit_offset, piece.unit_offset + piece.numel
            rec = PieceRecord(names[piece.segment.name], piece.start, piece.stop)
            rec.tensors[PARAM] = run.unit.param_range(ua, ub)
            if run.unit.separate_master:
                rec.tensors[MASTER] = run.unit.master_range(ua, ub)
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    rec.tensors[f"state.{k}"] = v[ua - run.a:ub - run.a]
                else:
                    rec.scalars[k] = v
            records.append(rec)
    return records


def full_tensors(model: Optional[nn.Module], opt: Any) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Model state the optimizer does not shard (buffers, frozen parameters), written whole
    by rank 0; and aliases (tied weights: state_dict name -> the stored name)."""
    if model is None:
        return {}, {}
    trained = {id(p) for g in opt.param_groups for p in g["params"] if p.requires_grad} if opt else set()
    first: dict[int, str] = {}
    full, aliases = {}, {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in first:
            aliases[name] = first[id(t)]
            continue
        first[id(t)] = name
        if id(t) not in trained:
            full[name] = t.detach()
    return full, aliases


def gather_table(per_rank: list[list[dict]], shapes: dict[str, dict]) -> dict[str, dict]:
    """The manifest's tensor table from every rank's piece entries (rank 0 builds it)."""
    table = {name: {**meta, "pieces": []} for name, meta in shapes.items()}
    for entries in per_rank:
        for e in entries:
            table[e.pop("name")]["pieces"].append(e)
    for meta in table.values():
        meta["pieces"].sort(key=lambda e: e["start"])
    return table
