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

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import nn

from zeroshard.checkpoint.shard_file import Deferred
from zeroshard.units.run import elementwise_state, flat

if TYPE_CHECKING:
    from zeroshard.optim.zero_optimizer import ZeroOptimizer

PARAM, MASTER = "param", "master"


@dataclass
class PieceRecord:
    """Range ``[start, stop)`` of parameter ``name``: its tensors by kind (``param``,
    ``master``, ``state.<key>``) and its scalar optimizer states (e.g. ``step``)."""

    name: str
    start: int
    stop: int
    tensors: dict[str, "torch.Tensor | Deferred"] = field(default_factory=dict)
    scalars: dict[str, Any] = field(default_factory=dict)
    run: Optional[int] = None  # index in opt.runs: a run's tensors are stored kind by kind

    def key(self, kind: str) -> str:
        return f"{self.name}|{self.start}|{kind}"


def model_names(model: Optional[nn.Module]) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()} if model is not None else {}


def name_map(model: Optional[nn.Module], opt: "ZeroOptimizer") -> dict[str, str]:
    """Optimizer parameter name -> checkpoint name."""
    by_id = model_names(model)
    out = {}
    for g in opt.param_groups:
        for p in g["params"]:
            own = opt.engine.param_names[id(p)]
            out[own] = by_id.get(id(p), own)
    return out


def write_range(opt: "ZeroOptimizer", unit: Any) -> tuple[int, int]:
    """The unit range this rank writes: what it owns when state is sharded; at stage 0 every
    rank holds everything, so rank r writes slice r and the write load stays balanced."""
    if opt.engine.policy.shard_optimizer:
        return unit.owned
    return unit.layout.slice_of(opt.engine.comm.rank)


def owned_pieces(model: Optional[nn.Module], opt: "ZeroOptimizer") -> list[PieceRecord]:
    """This rank's pieces, as views of the live tensors (callers copy before training goes on)."""
    names = name_map(model, opt)
    records = []
    for ri, run in enumerate(opt.engine.joined().runs):
        wlo, whi = write_range(opt, run.unit)
        lo, hi = max(run.a, wlo), min(run.b, whi)
        if lo >= hi:
            continue
        swapper = opt.engine.joined().swapper
        store = getattr(run.unit, "swap", None)
        state = swapper.scalars(run.tensor) if swapper is not None else opt.engine.joined().inner.state.get(run.tensor, {})
        tp = opt.engine.tp
        for piece in run.unit.layout.pieces_in(lo, hi):
            ua, ub = piece.unit_offset, piece.unit_offset + piece.numel
            off = 0
            if tp is not None:  # Note [stored order]; replicated tensors come from tp rank 0
                if not tp.writes(piece.segment.name):
                    continue
                off = tp.stored_offset(piece.segment.name)
            rec = PieceRecord(names[piece.segment.name], off + piece.start, off + piece.stop, run=ri)
            # Swapped parts are read from the swap file when the writer gets to them.
            # (swapped() is True only with a swap file: store is not None there)
            rec.tensors[PARAM] = (_deferred(run.unit.dtype, store.read_range, run.unit, "shard", ua, ub)
                                  if store is not None and run.unit.swapped("shard") else run.unit.param_range(ua, ub))
            if run.unit.separate_master:
                rec.tensors[MASTER] = (_deferred(torch.float32, store.read_range, run.unit, "master", ua, ub)
                                       if store is not None and run.unit.swapped("master")
                                       else run.unit.master_range(ua, ub))
            for k, v in state.items():
                if elementwise_state(v, run.tensor):
                    rec.tensors[f"state.{k}"] = flat(v)[ua - run.a:ub - run.a]
                else:
                    rec.scalars[k] = v
            if swapper is not None:  # the moments stream from the swap file too
                for k in swapper.tensor_keys_of(run.tensor):
                    rec.tensors[f"state.{k}"] = _deferred(swapper.key_dtype(run.tensor, k), swapper.read_range,
                                                          run.tensor, k, ua - run.a, ub - run.a)
            records.append(rec)
    return records


def _deferred(dtype: torch.dtype, read: Callable[..., torch.Tensor], *args: Any) -> Deferred:
    lo, hi = args[-2], args[-1]
    return Deferred(dtype, (hi - lo,), functools.partial(read, *args))


def has_deferred(records: list[PieceRecord]) -> bool:
    return any(isinstance(t, Deferred) for r in records for t in r.tensors.values())


def full_tensors(model: Optional[nn.Module], opt: Any, frozen: bool = True
                 ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Model state the optimizer does not shard (buffers and, with ``frozen``, frozen
    parameters held whole), written whole by rank 0; and aliases (tied weights: state_dict
    name -> the stored name). Frozen weights in stage-3 frozen units are pieces, never here
    (Note [frozen weights in checkpoints] in frozen_base.py)."""
    if model is None:
        return {}, {}
    # (what the units hold is pieces; a parameter in no unit, e.g. stage 3's zero-element ones,
    # is written whole like a buffer)
    managed = set(opt.segment_index()) if opt is not None else set()
    first: dict[int, str] = {}
    full, aliases = {}, {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in first:
            aliases[name] = first[id(t)]
            continue
        first[id(t)] = name
        if id(t) in managed:
            continue
        if not frozen and isinstance(t, nn.Parameter) and not t.requires_grad and t.is_floating_point():
            continue
        full[name] = stored_view(t.detach())
    return full, aliases


def stored_view(t: torch.Tensor) -> torch.Tensor:
    """What a tensor held whole is stored as: a complex one as its reals, ``(*shape, 2)``, like
    a trained complex parameter (Note [complex parameters]); a view, so a load writes through."""
    return torch.view_as_real(t) if t.is_complex() else t


def gather_table(per_rank: list[list[dict]], shapes: dict[str, dict]) -> dict[str, dict]:
    """The manifest's tensor table from every rank's piece entries (rank 0 builds it)."""
    table = {name: {**meta, "pieces": []} for name, meta in shapes.items()}
    for entries in per_rank:
        for e in entries:
            table[e.pop("name")]["pieces"].append(e)
    for meta in table.values():
        meta["pieces"].sort(key=lambda e: e["start"])
    return table
