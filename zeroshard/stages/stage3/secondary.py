"""ZeRO++ hpZ: a secondary partition of stage-3 parameters inside each node.

Note [hpZ secondary partition]: ``ZeroOptimizer(model, cls, stage=3, mesh=mesh_2d, hpz=True)``
keeps, per unit and rank, secondary slice ``l`` (of ``k``, the node size) of the unit's
parameters in the model dtype, beside the primary slice (of N) that the optimizer updates.
The primary slice is a sub-slice of the secondary one (Note [hpZ slice order] in
zeroshard/comm/hierarchical.py), so

- ``rebuild`` (after every step, and after a checkpoint load) copies the updated primary
  slice in and all-gathers the secondary slice across nodes: the one crossing of node
  boundaries by parameters per step, 1/k of the unit per rank;
- a unit's gather in forward or backward copies the secondary slice into the gathered
  buffer and all-gathers inside the node only.

Weights written outside the step (``model.load_state_dict``, ``load_safetensors``,
``init_meta_weights``, an in-place op on a sharded parameter) mark their units stale
(``params_written``, called by every rank for the same units) and the unit is rebuilt
before its next gather. The memory cost is ZeRO++'s: unit numel / k elements of the model
dtype per rank (``memory_report().secondary``), on the model's device even under
``offload_params="cpu"`` (its collectives run there).
"""
from __future__ import annotations

import weakref
from typing import Optional, Sequence

import torch

from zeroshard.comm import Work
from zeroshard.comm.codecs.link_codecs import LinkCodecs
from zeroshard.comm.hierarchical import HierarchicalComm
from zeroshard.memory import tensor_bytes
from zeroshard.units.flat_unit import FlatUnit

_OWNERS: "weakref.WeakKeyDictionary[FlatUnit, SecondaryPartition]" = weakref.WeakKeyDictionary()


def params_written(unit: FlatUnit) -> None:
    """``unit``'s primary slice changed outside the step: its secondary slice is rebuilt
    before the next gather. Every rank must call it for the same units (a rebuild is a
    collective), including ranks that own nothing of what was written."""
    owner = _OWNERS.get(unit)
    if owner is not None:
        owner.stale[owner.index[id(unit)]] = True


class SecondaryPartition:
    def __init__(self, units: Sequence[FlatUnit], comm: HierarchicalComm, codecs: Optional[LinkCodecs] = None) -> None:
        self.units = list(units)
        self.codecs = codecs
        """The rebuild across nodes and the gathers inside them through their links' weight
        codecs (Note [quantized collectives] in zeroshard/comm/codecs/coded.py)."""
        self.node, self.inter = comm.node, comm.inter
        self.index = {id(u): i for i, u in enumerate(self.units)}
        # On the model's device even when offload_params puts the shard on the host: the
        # collectives that rebuild and gather it run there (NCCL moves no host memory).
        self.slices = [torch.zeros(u.layout.padded_numel // self.node.world_size, dtype=u.dtype,
                                   device=u.device) for u in self.units]
        self.stale = [True] * len(self.units)
        for u in self.units:
            _OWNERS[u] = self
        self.rebuild([i for i, u in enumerate(self.units) if not u.needs_init])  # (the rest: once loaded)

    def _range(self, unit: FlatUnit) -> tuple[int, int]:
        n = unit.layout.padded_numel // self.node.world_size
        return self.node.rank * n, (self.node.rank + 1) * n

    def rebuild(self, which: Sequence[int] | None = None) -> None:
        """Secondary slices from the primary ones (a collective across nodes)."""
        todo = range(len(self.units)) if which is None else which
        works = []
        for ui in todo:
            unit, sec = self.units[ui], self.slices[ui]
            lo = unit.owned[0] - self._range(unit)[0]
            sec[lo:lo + unit.shard.numel()].copy_(unit.shard)
            works.append(self.inter.gather_shards(sec, self.codecs))
        for w in works:
            w.wait()
        for ui in todo:
            self.stale[ui] = False

    def gather(self, ui: int) -> Work:
        """Starts unit ``ui``'s gather into its (allocated) flat buffer, inside the node."""
        if self.stale[ui]:
            self.rebuild([ui])
        unit = self.units[ui]
        lo, hi = self._range(unit)
        unit.flat[lo:hi].copy_(self.slices[ui])
        return self.node.gather_shards(unit.flat, self.codecs)

    def nbytes(self) -> int:
        return sum(tensor_bytes(s) for s in self.slices)
