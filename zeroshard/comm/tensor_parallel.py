"""Parameters that are DTensors over a tensor-parallel mesh: what zeroshard keeps of them.

Note [tensor-parallel parameters]: a model parallelised with torch's ``parallelize_module``
(``ColwiseParallel`` / ``RowwiseParallel`` on the "tp" dimension of a ("dp", "tp")
``DeviceMesh``) has DTensor parameters: each tp rank holds its shard, the *local tensor*.
zeroshard shards along "dp" only, and to it a DTensor parameter is its local tensor:

- the flat units hold local tensors (this rank's TP shard), element-sliced over the dp
  group as usual; the parameter the model sees stays the same DTensor object, whose
  ``_local_tensor`` becomes a view into the unit's flat buffer (what FSDP2 does to its own
  sharded DTensors), so the gather after the step writes straight into the model;
- gradients arrive as DTensors with the parameter's placements; their local tensors go into
  the buckets and are reduced over dp only (the tp ranks of a parameter hold different
  elements; replicated parameters such as norms get identical gradients on every tp rank,
  because TP's own collectives made their inputs identical). After backward ``p.grad`` is a
  DTensor over the tp mesh whose local tensor is the published gradient (a view at stages
  0-1, a ``ShardedTensor`` piece at stages 2-3);
- a clipping norm counts every element once: TP-sharded pieces on every tp rank, replicated
  ones on tp rank 0 only, summed over dp and then over tp;
- checkpoints record, per TP-sharded tensor, the global name and shape and how the tensor
  is split (``split``: dimension and the chunk sizes of the tp ranks); a piece's range is
  in the *stored order*, the tp chunks one after the other, each flattened. A loader at any
  layout reads the chunks' rows it needs and assembles its own part
  (``zeroshard/checkpoint/tp_layout.py``). Replicated parameters are written by tp rank 0.

Stage 3: the parameter between uses (Note [sharded parameters]) is a DTensor with the
parameter's placements around the ``ShardedTensor`` of its owned piece; while its unit is
gathered the module holds the original DTensor, whose local tensor views the gathered buffer.

Limits: fp32 parameters only (the DTensor wrapper keeps its dtype, so a bf16 flat buffer
cannot stand behind it), no NVMe offload, no hybrid (3-D) mesh, DTensors on a 1-D mesh with
``Shard`` or ``Replicate`` placements.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, TypeGuard

import torch
import torch.distributed as dist

from zeroshard.comm.process_group import Comm

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor


def is_dtensor(t: object) -> TypeGuard[DTensor]:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # (torch without DTensor)
        return False
    return isinstance(t, DTensor)


def local_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor zeroshard lays out: a DTensor's local shard, anything else itself."""
    return t._local_tensor if is_dtensor(t) else t


def local_grad(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """A gradient torch produced or assigned, as the local tensor zeroshard's stores hold
    (a DTensor gradient is first brought to its parameter's placements)."""
    if not is_dtensor(grad):
        return grad
    if is_dtensor(param) and tuple(grad.placements) != tuple(param.placements):
        grad = grad.redistribute(placements=param.placements)
    return grad.to_local()


def as_param_grad(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """The ``.grad`` torch code sees: for a DTensor parameter a DTensor over ``local``."""
    if not is_dtensor(param):
        return local
    from torch.distributed.tensor import DTensor
    # Built around ``local`` itself, not through ``from_local``: that takes a view of it, which
    # for a ShardedTensor piece (stage 2) would gather the whole gradient into a detached
    # tensor, and in-place changes to ``.grad`` would no longer reach the store.
    return DTensor(local, param._spec, requires_grad=False)


def as_sharded_parameter(param: torch.Tensor, sharded: torch.Tensor) -> torch.nn.Parameter:
    """Stage 3's parameter between uses (Note [sharded parameters]): ``sharded`` itself, or
    for a DTensor parameter a DTensor with its placements around it."""
    if not is_dtensor(param):
        return torch.nn.Parameter(sharded, requires_grad=param.requires_grad)
    from torch.distributed.tensor import DTensor
    return torch.nn.Parameter(DTensor(sharded, param._spec, requires_grad=False), requires_grad=param.requires_grad)


@dataclass(frozen=True)
class Split:
    """How a TP-sharded tensor of ``shape`` is cut: along ``dim``, tp rank k holding
    ``sizes[k]`` of it (torch's chunking; the last chunks may be smaller or empty)."""

    dim: int
    sizes: tuple[int, ...]

    def dim_offset(self, part: int) -> int:
        return sum(self.sizes[:part])

    def part_numel(self, shape: tuple[int, ...], part: int) -> int:
        rest = 1
        for i, d in enumerate(shape):
            if i != self.dim:
                rest *= d
        return self.sizes[part] * rest

    def stored_offset(self, shape: tuple[int, ...], part: int) -> int:
        """Where chunk ``part`` starts in the stored order (the chunks back to back)."""
        return sum(self.part_numel(shape, k) for k in range(part))

    def manifest(self) -> dict:
        return {"dim": self.dim, "sizes": list(self.sizes)}


@dataclass(frozen=True)
class TpParam:
    """One DTensor parameter: its global shape and stride, placements, and (Shard) split."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    placements: tuple
    split: Optional[Split]
    part: int
    local_shape: torch.Size


class TensorParallel:
    """The tensor-parallel side of a ZeroOptimizer: the tp group and every DTensor parameter."""

    def __init__(self, mesh: Any, group: dist.ProcessGroup, params: dict[int, TpParam], names: dict[int, str],
                 dp: Comm) -> None:
        self.mesh = mesh
        """The DTensors' 1-D tp mesh (whole tensors are rebuilt over it: ``full``)."""
        self.comm = Comm(group, dimension="tp")
        self.params = params
        self.by_name = {names[i]: info for i, info in params.items()}
        mine = dist.get_process_group_ranks(dp.group) if dp.group is not None else [dist.get_rank()]
        self.checkpoint_ranks = sorted({r for ranks in self.comm.all_gather_object(mine) for r in ranks})
        """Every rank of the dp x tp arrangement: they all write checkpoint files."""

    # -- parameters ---------------------------------------------------------------------------
    def local_shapes(self) -> dict[int, torch.Size]:
        """id(param) -> the shape zeroshard lays out (the local shard's)."""
        return {i: info.local_shape for i, info in self.params.items()}

    def replicated(self, name: str) -> bool:
        """Every tp rank holds the same values (a plain parameter, or a Replicate DTensor)."""
        info = self.by_name.get(name)
        return info is None or info.split is None

    def global_shape(self, name: str, local_shape: Any) -> tuple[int, ...]:
        info = self.by_name.get(name)
        return tuple(local_shape) if info is None else info.shape

    def writes(self, name: str) -> bool:
        """This rank writes ``name``'s pieces to checkpoints (replicated ones: tp rank 0)."""
        return self.comm.rank == 0 or not self.replicated(name)

    def stored_offset(self, name: str) -> int:
        """Where this rank's chunk of ``name`` starts in its stored order (Note [stored order])."""
        info = self.by_name.get(name)
        return 0 if info is None or info.split is None else info.split.stored_offset(info.shape, info.part)

    def split_of(self, name: str) -> Optional[tuple[Split, int]]:
        info = self.by_name.get(name)
        return None if info is None or info.split is None else (info.split, info.part)

    # -- gradients ----------------------------------------------------------------------------
    def counted_ranges(self, unit: Any) -> Optional[list[tuple[int, int]]]:
        """Ranges of ``unit``'s owned gradient that this rank counts in a norm (relative to the
        owned range), or None for all of it: tp rank 0 counts everything, the others only
        their TP-sharded pieces (replicated gradients are the same on every tp rank)."""
        if self.comm.rank == 0:
            return None
        lo, hi = unit.owned
        return [(p.unit_offset - lo, p.unit_offset - lo + p.numel) for p in unit.layout.pieces_in(lo, hi)
                if not self.replicated(p.segment.name)]

    # -- whole tensors ------------------------------------------------------------------------
    def full(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The global tensor from every tp rank's ``local`` part (a collective over tp for a
        TP-sharded ``name``; every tp rank must call it in the same order)."""
        info = self.by_name.get(name)
        if info is None or info.split is None:
            return local
        from torch.distributed.tensor import DTensor
        return DTensor.from_local(local.contiguous(), self.mesh, info.placements, run_check=False,
                                  shape=torch.Size(info.shape), stride=info.stride).full_tensor()

    def local_part(self, name: str, value: Any) -> Any:
        """This tp rank's part of a global tensor of ``name`` (anything else unchanged)."""
        info = self.by_name.get(name)
        if info is None or info.split is None or not isinstance(value, torch.Tensor) \
                or tuple(value.shape) != info.shape:
            return value
        return value.narrow(info.split.dim, info.split.dim_offset(info.part), info.split.sizes[info.part])


def from_dtensors(dts: list[DTensor], names: dict[int, str], dp: Comm, hybrid: bool, mesh: "DeviceMesh",
                  tp_group: dist.ProcessGroup, tp_rank: int) -> TensorParallel:
    """The TensorParallel of the DTensor parameters ``dts`` on the 1-D tp ``mesh`` (its group
    and this rank's coordinate in it, read by comm/mesh.py's ``mesh_info``); refuses what is not
    supported (Note [tensor-parallel parameters])."""
    first = names.get(id(dts[0]), "?")
    from torch.distributed.tensor import Shard
    out: dict[int, TpParam] = {}
    for p in dts:
        n = names.get(id(p), "?")
        if p.device_mesh != mesh:
            raise ValueError(f"DTensor parameter {n!r} lives on {p.device_mesh}; ZeroOptimizer takes DTensors on "
                             f"one 1-D tensor-parallel mesh (e.g. mesh['tp']), like {first!r} on {mesh}")
        place = p.placements[0]
        if not (isinstance(place, Shard) or place.is_replicate()):  # (isinstance: what is_shard() tests)
            raise ValueError(f"DTensor parameter {n!r} has placement {place}; only Shard and Replicate are supported")
        out[id(p)] = TpParam(tuple(p.shape), tuple(p.stride()), tuple(p.placements),
                             Split(place.dim, ()) if isinstance(place, Shard) else None, tp_rank,
                             p._local_tensor.shape)
    if dp.group is not None and not hybrid:  # (a hybrid mesh is refused by check_composition: optim/composition.py)
        overlap = set(dist.get_process_group_ranks(dp.group)) & set(dist.get_process_group_ranks(tp_group))
        if overlap != {dist.get_rank()}:
            raise ValueError(
                f"the data-parallel group and the parameters' tensor-parallel mesh {mesh} share ranks "
                f"{sorted(overlap)}: gradients would be averaged over tp too. Pass the 2-D mesh "
                "(mesh=init_device_mesh(..., mesh_dim_names=('dp', 'tp'))) or its mesh['dp'] (or process_group=)")
    # Chunk sizes along the split dimension, from every tp rank (exact for uneven splits).
    # (ordered by mesh coordinate: chunk k is coordinate k's; a Comm of its own, so this gather
    # is not counted in the tp group's traffic)
    gathered = Comm(tp_group).all_gather_object((tp_rank, [
        p._local_tensor.shape[split.dim] if (split := out[id(p)].split) is not None else 0 for p in dts]))
    sizes = [s for _, s in sorted(gathered)]
    for i, p in enumerate(dts):
        info = out[id(p)]
        if info.split is not None:
            out[id(p)] = TpParam(info.shape, info.stride, info.placements,
                                 Split(info.split.dim, tuple(s[i] for s in sizes)), info.part, info.local_shape)
    return TensorParallel(mesh, tp_group, out, names, dp)
