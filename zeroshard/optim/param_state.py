"""``opt.state[p]``: torch.optim's per-parameter state, as a read-only view.

The inner optimizer keeps state per *run* (one tensor per unit and param group, this rank's
owned range), so there is no per-parameter dict to hand out. ``ParamStateView`` builds one
on access: for each state key, the elements this rank owns of ``p`` (a copy), shaped like
``p`` when this rank owns all of it (stage 0, or world size 1) and as a flat tensor of the
owned elements otherwise; scalars (``step``) as they are. Writes are refused: the values
would not reach the runs. To change state, ``load_state_dict``.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from zeroshard.units.run import elementwise_state, flat

if TYPE_CHECKING:
    from zeroshard.optim.zero_engine import EngineOwner


class ParamStateView(Mapping):
    def __init__(self, opt: "EngineOwner") -> None:
        # (it holds the optimizer, as torch's state dict is held by it: the optimizer lives until
        # collected, not until its last name goes, as code that builds one and drops it expects)
        self._opt = opt

    def _pieces(self, p: torch.Tensor) -> list:
        self._opt.engine.inflight.join()  # (never a step half done: Note [overlapped step])
        out = []
        for run in self._opt.engine.runs:
            for piece in run.unit.layout.pieces_in(run.a, run.b):
                if piece.segment.name == self._opt.engine.param_names.get(id(p)) and piece.numel:
                    out.append((run, piece))
        return out

    def __getitem__(self, p: Any) -> dict:
        if not isinstance(p, torch.Tensor):
            raise KeyError(p)
        pieces = self._pieces(p)
        if not pieces:
            return {}
        out: dict[str, Any] = {}
        state = self._opt.engine.inner.state
        for run, piece in sorted(pieces, key=lambda rp: rp[1].start):
            lo = piece.unit_offset - run.a
            for k, v in state.get(run.tensor, {}).items():
                if elementwise_state(v, run.tensor):
                    out.setdefault(k, []).append(flat(v)[lo:lo + piece.numel])
                else:
                    out.setdefault(k, v)
        owned = sum(piece.numel for _, piece in pieces)
        seg = pieces[0][1].segment
        for k, v in out.items():
            if isinstance(v, list):
                t = torch.cat(v)  # (a complex parameter's pieces are whole complex numbers: Note [complex parameters])
                t = torch.view_as_complex(t.view(-1, 2)) if seg.complex_dtype is not None else t
                out[k] = t.view(p.shape) if owned == seg.numel else t
        return out

    def __contains__(self, p: object) -> bool:
        return isinstance(p, torch.Tensor) and bool(self[p])

    def __iter__(self) -> Iterator[torch.Tensor]:
        for g in self._opt.param_groups:
            for p in g["params"]:
                if p in self:
                    yield p

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __setitem__(self, p: Any, value: Any) -> None:
        raise TypeError("ZeroOptimizer.state is a read-only view of this rank's shard of the state; "
                        "change optimizer state with load_state_dict()")

    def __repr__(self) -> str:
        return f"ParamStateView({len(self)} parameters with state on this rank)"
