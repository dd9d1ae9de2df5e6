"""Which process groups a ZeroOptimizer shards over and replicates over.

Note [hybrid sharding]: ``ZeroOptimizer(..., mesh=DeviceMesh)`` follows FSDP2's convention.
A 1-D mesh is one data-parallel group (like ``process_group=``). A 2-D mesh is
(replicate, shard): optimizer state, gradients and (stage 3) parameters are sharded over the
*shard* dimension — typically the GPUs of one node — and replicated over the *replicate*
dimension, across nodes. Gradients are reduced inside the shard group first (reduce-scatter
at stages 2-3, so only this rank's slice remains), and that slice alone is then all-reduced
across the replicas: the slow links carry 1/shard_size of the gradient, and parameter gathers
(after the step, or stage 3's per unit) never leave the shard group. Each replica steps the
same slices, so replicas stay identical without exchanging parameters. A named mesh is read
by its names, in either order (replicate: "dp_replicate", "replicate" or "node"; shard:
"dp_shard", "shard" or "local"), anything else refused; an unnamed one by position.

With ``hpz=True`` (stage 3, ZeRO++) the same 2-D mesh reads as (nodes, ranks in a node):
state is sharded over all its ranks and the parameters get a secondary partition inside the
node (Note [hpZ slice order] in hierarchical.py).

A mesh with a dimension named "tp" is a (dp, tp) mesh for tensor parallelism: zeroshard takes
the other dimension(s) as its data-parallel mesh (Note [tensor-parallel parameters] in
``tensor_parallel.py``). Such a mesh needs DTensor parameters: with plain ones each tp rank
would train its own copy and write the same checkpoint files, so it is refused.

A mesh with a dimension named "pp" is a ("pp", "dp"[, "tp"]) mesh for pipeline parallelism:
zeroshard shards over "dp" and records the pp group (Note [pipeline parallelism] in
``pipeline.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, ClassVar, Optional, Sequence, Union, cast

import torch
import torch.distributed as dist

from zeroshard.comm import tensor_parallel
from zeroshard.comm.hierarchical import HierarchicalComm
from zeroshard.comm.pipeline import PipelineParallel
from zeroshard.comm.process_group import Comm
from zeroshard.comm.tensor_parallel import TensorParallel, is_dtensor

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from zeroshard.config import ZeroConfig


# Note [the mesh variant is the type]: how the data-parallel ranks are arranged decides what
# shards, reduces, gathers and saves, so each arrangement is its own class (as FSDP2's
# ``FSDPMeshInfo`` / ``HSDPMeshInfo``): ``FlatMesh`` (one group), ``HybridMesh`` (a shard group
# and its replicas, Note [hybrid sharding]) and ``HpzMesh`` (hpZ's hierarchical group, Note [hpZ
# slice order]). ``MeshInfo`` is their union: code that does something only for one variant asks
# ``isinstance(mesh, HybridMesh)``, and code that only passes a group on reads ``mesh.replicas``
# (None on the variants without replicas). Tensor and pipeline parallelism compose with the
# data-parallel variants, so they are optional parts of each (``tp``, ``pp``). ``mesh_info``
# below is the one place a DeviceMesh (or process group) is read; tensor_parallel.py and
# pipeline.py build their parts from what it read.
@dataclass(frozen=True)
class _MeshParts:
    """What every variant holds: ``comm``, the group state is sharded over; ``tp``, the
    tensor-parallel layout of DTensor parameters (Note [tensor-parallel parameters]); ``pp``,
    this rank's pipeline stage and its peers in the others (Note [pipeline parallelism])."""
    comm: Comm
    tp: Optional[TensorParallel] = field(default=None, kw_only=True)
    pp: Optional[PipelineParallel] = field(default=None, kw_only=True)

    @property
    def data_parallel_size(self) -> int:
        """Ranks whose gradients are averaged (a hybrid mesh: the shard group times its replicas)."""
        return self.comm.world_size

    def local_shapes(self) -> dict[int, torch.Size]:
        """This rank's shapes of the tensor-parallel parameters (none without TP)."""
        return self.tp.local_shapes() if self.tp is not None else {}


@dataclass(frozen=True)
class FlatMesh(_MeshParts):
    """One data-parallel group (``process_group=`` or a 1-D mesh): shards over all of it."""
    replicas: ClassVar[None] = None
    shard_group_ranks: ClassVar[None] = None


@dataclass(frozen=True)
class HybridMesh(_MeshParts):
    """A 2-D (replicate, shard) mesh (Note [hybrid sharding]): ``comm`` is this rank's shard
    group, ``replicas`` its replicate group, ``shard_group_ranks`` every shard group's ranks
    (one row per shard group) so every rank can make each shard group's side groups."""
    replicas: Comm
    shard_group_ranks: tuple[tuple[int, ...], ...]

    @property
    def data_parallel_size(self) -> int:
        return self.comm.world_size * self.replicas.world_size


@dataclass(frozen=True)
class HpzMesh(_MeshParts):
    """hpZ (``hpz=True``) on a (nodes, ranks per node) mesh: ``comm`` spans every rank, its
    collectives split into the node and inter-node levels (Note [hpZ slice order])."""
    comm: HierarchicalComm
    replicas: ClassVar[None] = None
    shard_group_ranks: ClassVar[None] = None


MeshInfo = Union[FlatMesh, HybridMesh, HpzMesh]
"""Where one ZeroOptimizer's ranks sit, built once by the assembly (zeroshard/optim/assembly.py)
and handed to what shards, reduces, gathers and saves (Note [the mesh variant is the type])."""


def mesh_info(process_group: Optional[dist.ProcessGroup], mesh: object, config: "ZeroConfig",
              params: Sequence[torch.Tensor], names: dict[int, str]) -> MeshInfo:
    """The MeshInfo of ``process_group=`` or ``mesh=`` over these parameters (their DTensors
    decide tensor parallelism): the one place a mesh is read (Note [the mesh variant is the type])."""
    pp = _pipeline(_checked(mesh)) if "pp" in _dim_names(mesh) else None
    dp = data_parallel(process_group, mesh, config.hpz)
    # (data_parallel refused a mesh that is not a DeviceMesh holding this rank)
    tp = _tensor_parallel(list(params), names, dp.comm, isinstance(dp, HybridMesh),
                          cast(Optional["DeviceMesh"], mesh))
    return replace(dp, tp=tp, pp=pp)


def _dim_names(mesh: object) -> tuple[str, ...]:
    return tuple(getattr(mesh, "mesh_dim_names", None) or ())


def _pipeline(mesh: "DeviceMesh") -> PipelineParallel:
    """The PipelineParallel of a mesh with a "pp" dimension; refuses a mesh of another shape.
    What pp does not compose with (stage 3, hpZ, NVMe) is refused by ``check_composition``
    (zeroshard/optim/composition.py; Note [pipeline parallelism])."""
    dims = _dim_names(mesh)
    rest = [n for n in dims if n not in ("pp", "tp")]
    if rest != ["dp"]:
        raise ValueError(f"mesh_dim_names={dims}: a pipeline-parallel mesh is ('pp', 'dp') or ('pp', 'dp', 'tp'); "
                         "a hybrid (replicate, shard) data-parallel dimension with pp is not supported yet")
    pp_mesh = mesh["pp"]
    coord = list(mesh.get_coordinate() or ())
    others = [c for n, c in zip(dims, coord) if n != "pp"]
    return PipelineParallel(Comm(pp_mesh.get_group(), dimension="pp"), pp_mesh.get_local_rank(), pp_mesh.size(),
                            tuple(sorted(mesh.mesh.flatten().tolist())), all(c == 0 for c in others))


def _tensor_parallel(params: list[torch.Tensor], names: dict[int, str], dp: Comm, hybrid: bool,
                     mesh: Optional["DeviceMesh"]) -> Optional[TensorParallel]:
    """The TensorParallel of these parameters, or None when none is a DTensor; refuses what
    is not supported (Note [tensor-parallel parameters]). ``mesh``: the one passed as ``mesh=``."""
    dts = [p for p in params if is_dtensor(p)]
    if not dts:
        if mesh is not None and "tp" in _dim_names(mesh) and mesh["tp"].size() > 1:
            # (each tp coordinate would train its own copy, and all of them save as the same ranks)
            raise ValueError(f"mesh={mesh} has a 'tp' dimension of size {mesh['tp'].size()} but no parameter is a "
                             "DTensor: every tp rank would train its own copy of the model. Parallelise the model "
                             "over mesh['tp'] first (torch's parallelize_module), or for data parallelism alone pass "
                             "a mesh without 'tp' over every rank (not this mesh's mesh['dp']) or process_group=")
        return None
    tp_mesh = dts[0].device_mesh
    if tp_mesh.ndim != 1:
        first = names.get(id(dts[0]), "?")
        raise ValueError(f"DTensor parameter {first!r} lives on {tp_mesh}; ZeroOptimizer takes DTensors on "
                         f"one 1-D tensor-parallel mesh (e.g. mesh['tp']), like {first!r} on {tp_mesh}")
    return tensor_parallel.from_dtensors(dts, names, dp, hybrid, tp_mesh, tp_mesh.get_group(0),
                                         tp_mesh.get_local_rank(0))


REPLICATE_NAMES = ("dp_replicate", "replicate", "node")
"""Names of the replicate (inter-node) dimension of a 2-D data-parallel mesh."""
SHARD_NAMES = ("dp_shard", "shard", "local")
"""Names of the shard (intra-node) dimension of a 2-D data-parallel mesh."""


def _checked(mesh: object) -> "DeviceMesh":
    """``mesh`` once it is a DeviceMesh that holds this rank."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError as exc:  # (very old torch)
        raise RuntimeError(f"mesh= needs torch.distributed.device_mesh: {exc}") from exc
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
    if mesh.get_coordinate() is None:  # (torch then fails with an IndexError on its groups)
        raise ValueError(f"mesh {mesh.mesh.tolist()} does not contain rank {dist.get_rank()}: every rank that "
                         "builds the ZeroOptimizer passes a mesh it belongs to (e.g. init_device_mesh over all "
                         "ranks, built the same on every rank)")
    return mesh


def data_parallel_mesh(mesh: "DeviceMesh") -> "DeviceMesh":
    """The mesh zeroshard shards over: ``mesh`` without its "tp" and "pp" dimensions (Note
    [tensor-parallel parameters], Note [pipeline parallelism])."""
    names = _dim_names(mesh)
    if "tp" not in names and "pp" not in names:
        return mesh
    rest = tuple(n for n in names if n not in ("tp", "pp"))
    if not rest:
        raise ValueError(f"mesh has only {names} dimension(s); pass the ('dp', 'tp') or ('pp', 'dp') mesh "
                         "(a 'dp' dimension of size 1 where there is no data parallelism)")
    return mesh[rest[0]] if len(rest) == 1 else mesh[rest]


def hybrid_dims(mesh: "DeviceMesh") -> tuple[int, int]:
    """(replicate, shard) dimensions of a 2-D data-parallel mesh: by name where it has names
    (in either order), else by position as FSDP2 does."""
    names = _dim_names(mesh)
    if not names:
        return 0, 1
    replicate = [i for i, n in enumerate(names) if n in REPLICATE_NAMES]
    shard = [i for i, n in enumerate(names) if n in SHARD_NAMES]
    if len(replicate) != 1 or len(shard) != 1:
        raise ValueError(f"mesh_dim_names={names}: a 2-D data-parallel mesh names one replicate dimension "
                         f"(one of {REPLICATE_NAMES}) and one shard dimension (one of {SHARD_NAMES}), e.g. "
                         "mesh_dim_names=('dp_replicate', 'dp_shard'); an unnamed mesh is read as (replicate, "
                         "shard). For tensor parallelism name the other dimension 'tp'")
    return replicate[0], shard[0]


def groups_from(process_group: Optional[dist.ProcessGroup], mesh: object) -> tuple[Optional[dist.ProcessGroup],
                                                                                 Optional[dist.ProcessGroup]]:
    """(shard group, replicate group or None) from ``process_group=`` or ``mesh=``."""
    if mesh is None:
        return process_group, None
    if process_group is not None:
        raise ValueError("pass either process_group= or mesh=, not both (a mesh names its own groups)")
    mesh = data_parallel_mesh(_checked(mesh))
    if mesh.ndim == 1:
        return mesh.get_group(0), None
    if mesh.ndim == 2:
        replicate, shard = hybrid_dims(mesh)
        return mesh.get_group(shard), mesh.get_group(replicate)
    names = getattr(mesh, "mesh_dim_names", None)
    raise ValueError(f"mesh has {mesh.ndim} dimensions {names or ''}; ZeroOptimizer takes a 1-D (shard) or "
                     "2-D (replicate, shard) data-parallel mesh: pass mesh['dp_replicate', 'dp_shard'] "
                     "or the data-parallel sub-mesh of a larger one")


def data_parallel(process_group: Optional[dist.ProcessGroup], mesh: object, hpz: bool) -> MeshInfo:
    """The data-parallel variant of ``process_group=`` or ``mesh=`` (without tp and pp): one
    group, a hybrid (replicate, shard) mesh (Note [hybrid sharding]), or hpZ's hierarchical group."""
    if hpz:
        return HpzMesh(_hpz_comm(process_group, mesh))
    shard_group, replicate_group = groups_from(process_group, mesh)
    if replicate_group is None:
        return FlatMesh(Comm(shard_group, dimension="dp"))
    dp = data_parallel_mesh(_checked(mesh))
    ranks = dp.mesh if hybrid_dims(dp)[1] == 1 else dp.mesh.transpose(0, 1)  # (one row per shard group)
    return HybridMesh(Comm(shard_group, dimension="shard"), Comm(replicate_group, dimension="replicate"),
                      tuple(tuple(row.tolist()) for row in ranks))


def _hpz_comm(process_group: Optional[dist.ProcessGroup], mesh: object) -> HierarchicalComm:
    if mesh is None or process_group is not None or getattr(mesh, "ndim", 0) != 2:
        raise ValueError("hpz=True needs mesh= a 2-D DeviceMesh of (nodes, ranks per node), e.g. "
                         "init_device_mesh('cuda', (nodes, gpus_per_node)), and no process_group=: the "
                         "secondary partition lives in dimension 1, inside each node")
    mesh = _checked(mesh)
    if "tp" in _dim_names(mesh):  # (the mesh's shape; DTensors: check_composition)
        raise ValueError("hpz=True with tensor parallelism (a mesh with a 'tp' dimension) is not supported yet; "
                         "use hpZ on a (nodes, ranks per node) data-parallel mesh, or TP without hpz")
    if sorted(mesh.mesh.flatten().tolist()) != list(range(dist.get_world_size())):
        raise ValueError(f"hpz=True needs a mesh over every rank (the default group is its data-parallel "
                         f"group); this one holds {mesh.mesh.numel()} of {dist.get_world_size()} ranks (a "
                         "data-parallel sub-mesh next to tensor parallelism is not supported with hpZ yet)")
    inter, node = hybrid_dims(mesh)
    return HierarchicalComm(None, node=Comm(mesh.get_group(node), dimension="shard"),
                            inter=Comm(mesh.get_group(inter), dimension="replicate"))
