"""A checkpoint's optimizer state checked against what the loading optimizer's classes keep.

The manifest's checks (validate.py) show that every piece is well formed and that pieces of
a group store the same kinds; they cannot show that those kinds are the loading optimizer's:
a Muon momentum stored as ``exp_avg``, Adafactor's ``row_var`` and ``col_var`` swapped, with
checksums recomputed, pass them. Here each parameter this rank's optimizer trains is compared
with its class's own state (Note [state kinds] in zeroshard/optim/state_kinds.py) before
anything is applied.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from zeroshard.checkpoint import jsontree
from zeroshard.checkpoint.checkpoint_errors import CheckpointMismatchError
from zeroshard.checkpoint.pieces import name_map
from zeroshard.optim.state_io import check_kinds

if TYPE_CHECKING:
    from zeroshard.optim.zero_optimizer import ZeroOptimizer


def check_state_kinds(body: dict, model: Optional[nn.Module], opt: Optional["ZeroOptimizer"], where: str) -> None:
    """Raises CheckpointMismatchError naming the parameter, the key and the shape its class
    keeps, for the first parameters whose saved state is not that class's."""
    if opt is None or not hasattr(opt, "engine"):
        return
    names = name_map(model, opt)
    local = {seg.name: tuple(seg.shape) for u in opt.engine.units for seg in u.layout.segments}
    tp = getattr(opt.engine, "tp", None)
    got: dict[str, tuple[dict[str, object], Optional[int]]] = {}
    for own, ckpt in names.items():
        meta = body["tensors"].get(ckpt)
        if own not in local or not isinstance(meta, dict) or meta.get("kind") != "sharded":
            continue
        state: dict[str, object] = {}
        for p in meta["pieces"]:
            # (stored sliced: state of the parameter's own shape)
            state.update({k[6:]: local[own] for k in p["keys"] if k.startswith("state.")})
            for k, v in p.get("scalars", {}).items():
                value = jsontree.decode(v, f"{where}: {ckpt} scalar {k!r}")
                # (a tensor-parallel part's per-tensor state is kept whole: its key is checked, not its shape)
                split = tp is not None and tp.split_of(own) is not None
                state[k] = ... if split and isinstance(value, torch.Tensor) and value.numel() > 1 else value
        got[own] = (state, None)
    try:
        check_kinds(opt, [{} for _ in opt.param_groups], got, where)
    except ValueError as exc:
        raise CheckpointMismatchError(str(exc)) from None
