"""``deepspeed.zero.GatheredParameters``: whole stage-3 parameters for the length of a block.

    with deepspeed.zero.GatheredParameters(model.head.weight, modifier_rank=0):
        if rank == 0:
            model.head.weight.data.normal_()

Inside the block the units holding the parameters are gathered, so the model's modules hold
the full tensors, and the parameters named read as whole tensors too (``p.detach().cpu()``
inside the block is the full weight, which rank 0 can ``torch.save``: Note [gathered reads]
in zeroshard/stages/sharded_tensor.py). With
``modifier_rank`` set, what that rank wrote is broadcast to every rank when the block ends
and written into each rank's shard and fp32 master, so the next step trains from it (with
``modifier_rank=None`` changes are discarded, as DeepSpeed discards them). At stages 0-2 every
rank already holds full parameters: reading needs nothing; ``modifier_rank`` still makes
every rank take that rank's values, masters included. Parameters no ZeroOptimizer manages
are left alone, as DeepSpeed leaves non-ZeRO parameters.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional, Union

import torch

from zeroshard.optim import ownership, registry
from zeroshard.layout.unit_layout import Segment
from zeroshard.units.flat_unit import FlatUnit
from zeroshard.stages.sharded_tensor import ShardedTensor
from zeroshard.stages.stage3.unit_state import UnitState
from zeroshard.optim.zero_optimizer import ZeroOptimizer

# Names of deepspeed.zero this front does not provide, and what to do instead.
_NOT_PROVIDED = {
    "Init": "build the model normally (initialize partitions it), or on the meta device with "
            "zeroshard.init_meta_weights / zeroshard.load_safetensors",
    "register_external_parameter": "make the module that uses the parameter part of a larger unit "
                                   "(ZeroOptimizer(..., stage3_unit_classes=[...]))",
    "TiledLinear": "not supported",
    "MiCS_Init": "not supported",
}


def __getattr__(name: str) -> Any:
    if name in _NOT_PROVIDED:
        raise AttributeError(f"deepspeed.zero.{name} is not supported by zeroshard's DeepSpeed front: "
                             f"{_NOT_PROVIDED[name]}")
    raise AttributeError(f"module 'zeroshard.zero' has no attribute {name!r}")


def _owner(p: torch.Tensor) -> Optional[ZeroOptimizer]:
    owner = ownership.live_owner(p)
    if isinstance(owner, ZeroOptimizer):
        return owner
    for ref in list(registry._BY_MODEL.values()):  # a stage-3 parameter as torch code sees it
        opt = ref()
        if opt is not None and not getattr(opt, "closed", False) and id(p) in opt.segment_index():
            return opt
    return None


class GatheredParameters:
    """Gathers ``params`` (one tensor or an iterable) on entry; see the module docstring.
    A collective: every rank of the optimizer's group enters and leaves it."""

    def __init__(self, params: Union[torch.Tensor, Iterable[torch.Tensor], None], modifier_rank: Optional[int] = None,
                 fwd_module: object = None, enabled: bool = True) -> None:
        if params is None:
            params = []
        elif isinstance(params, torch.Tensor):
            params = [params]
        else:
            params = list(params)
        bad = [type(p).__name__ for p in params if not isinstance(p, torch.Tensor)]
        if bad:
            raise TypeError(f"GatheredParameters(params): expected parameters, got {bad[:3]}")
        if modifier_rank is not None and (isinstance(modifier_rank, bool) or not isinstance(modifier_rank, int)):
            raise TypeError(f"GatheredParameters(modifier_rank={modifier_rank!r}) must be a rank (int) or None")
        if fwd_module is not None:
            raise ValueError("GatheredParameters(fwd_module=...) is not supported: zeroshard gathers whole units; "
                             "drop the argument")
        self.enabled = bool(enabled)
        self.modifier_rank = modifier_rank
        self._opt: Optional[ZeroOptimizer] = None
        self._targets: list[tuple[Any, Any]] = []  # (unit, segment) per managed parameter
        self._shown: list[tuple[ShardedTensor, FlatUnit, Segment]] = []  # (sharded parameter, unit, segment)
        self._gathered: list[int] = []  # units this block gathered (released again on exit)
        if not self.enabled:
            return
        owners = {id(o): o for o in (_owner(p) for p in params) if o is not None}
        if len(owners) > 1:
            raise ValueError("GatheredParameters: the parameters belong to different ZeroOptimizers; use one "
                             "block per model")
        if not owners:
            return
        self._opt = next(iter(owners.values()))
        where = self._opt.segment_index()
        seen: set[tuple[int, int]] = set()
        for p in params:
            unit, seg = where[id(p)]
            if isinstance(p, ShardedTensor) and p.sharded:
                self._shown.append((p, unit, seg))
            if (id(unit), seg.offset) not in seen:
                seen.add((id(unit), seg.offset))
                self._targets.append((unit, seg))
        if modifier_rank is not None and not 0 <= modifier_rank < self._opt.engine.comm.world_size:
            raise ValueError(f"GatheredParameters(modifier_rank={modifier_rank}) is not a rank of the "
                             f"optimizer's group (0..{self._opt.engine.comm.world_size - 1})")

    def __enter__(self) -> "GatheredParameters":
        opt = self._opt
        if opt is None:
            return self
        opt.finish_step()  # (an overlapped step writes the shards being gathered)
        if opt.engine.shards_parameters:
            gatherer = opt.engine.stage3_gatherer
            indices = {id(u): i for i, u in enumerate(opt.all_units)}
            for ui in sorted({indices[id(unit)] for unit, _ in self._targets}):
                if gatherer.state[ui] is UnitState.RELEASED:
                    self._gathered.append(ui)
                gatherer.ensure_exact(ui)
        for p, unit, seg in self._shown:  # the parameters read whole inside (Note [gathered reads])
            p.gathered = seg.bind(unit.flat[seg.offset:seg.end])
        return self

    def __exit__(self, *exc: object) -> None:
        opt = self._opt
        if opt is None:
            return
        for p, _, _ in self._shown:
            p.gathered = None
        try:
            if self.modifier_rank is not None and exc[0] is None:
                self._write_back(opt)
        finally:
            if opt.engine.shards_parameters:
                for ui in self._gathered:
                    opt.engine.stage3_gatherer.release(ui)
            self._gathered = []

    @torch.no_grad()
    def _write_back(self, opt: ZeroOptimizer) -> None:
        """The modifier rank's values everywhere: the full buffers, then each rank's shard and
        master (only of the parameters named, so the others keep their fp32 masters exact)."""
        views = [unit.flat[seg.offset:seg.end] for unit, seg in self._targets]
        opt.engine.comm.broadcast_tensors(views, src=int(self.modifier_rank or 0))
        for (unit, seg), view in zip(self._targets, views):
            unit.load_segment(seg.offset, view.clone())
