"""Which policies compose: the one place cross-axis refusals live (Note [one validator]).

``ZeroConfig`` checks each option and the options against each other; what needs the mesh too
-- pipeline parallelism with stage 3, hpZ or NVMe; tensor parallelism with mixed precision,
NVMe, a hybrid mesh, frozen stage-3 parameters or a whole-tensor optimizer; hpZ with tensor
parallelism -- is refused here, once the mesh is parsed (``MeshInfo``) and before anything is
built from it. The assembly calls ``check_composition`` on every rank with the same inputs, so
every rank refuses alike.
"""
from __future__ import annotations

from collections.abc import Sequence

from zeroshard.comm.mesh import HybridMesh, MeshInfo
from zeroshard.config import ZeroConfig


def check_composition(config: ZeroConfig, mesh: MeshInfo, frozen: Sequence[str] = (),
                      whole_groups: Sequence[int] = ()) -> None:
    """Refuses a config the mesh cannot run, naming both sides and the fix. ``frozen``: names of
    the frozen parameters; ``whole_groups``: param groups on an optimizer that reads whole tensors."""
    if mesh.pp is not None:
        _check_pipeline(config)
    if mesh.tp is not None:
        _check_tensor_parallel(config, mesh, frozen, whole_groups)


def _check_pipeline(config: ZeroConfig) -> None:
    if config.stage == 3:
        raise ValueError("stage=3 with pipeline parallelism (a 'pp' mesh dimension) is not supported: stage 3 "
                         "gathers each unit's parameters in forward and frees them after its backward, and a "
                         "pipeline schedule runs both once per micro-batch (2 x n_microbatches gathers per step; "
                         "FSDP2's reshard_after_forward=False keeps them whole instead, which is stage 2's "
                         "memory). Use stage=1 or stage=2")
    if config.hpz:
        raise ValueError("hpz=True with pipeline parallelism (a 'pp' mesh dimension) is not supported; use hpz "
                         "on a (nodes, ranks per node) mesh without pp")
    if config.optimizer_swapped or config.params_swapped:
        raise ValueError("NVMe offload with pipeline parallelism (a 'pp' mesh dimension) is not supported yet; "
                         "offload to 'cpu', or pass a mesh without pp")


def _check_tensor_parallel(config: ZeroConfig, mesh: MeshInfo, frozen: Sequence[str],
                           whole_groups: Sequence[int]) -> None:
    tp = mesh.tp
    if tp is None:  # (the caller tests it; for the type checker)
        return
    first = next(iter(tp.by_name), "?")
    if config.mixed_precision is not None:
        raise ValueError(f"parameter {first!r} is a DTensor: mixed_precision={config.mixed_precision!r} is not "
                         "supported with tensor parallelism (the DTensor keeps its dtype); use fp32 parameters")
    if config.optimizer_swapped:
        raise ValueError("offload_optimizer='nvme' is not supported with DTensor (tensor-parallel) parameters")
    if isinstance(mesh, HybridMesh):
        raise ValueError("a hybrid (replicate, shard) mesh together with tensor parallelism is not supported; "
                         "pass the ('dp', 'tp') mesh")
    if config.hpz:
        raise ValueError("hpz=True with tensor parallelism (a mesh with a 'tp' dimension) is not supported yet; "
                         "use hpZ on a (nodes, ranks per node) data-parallel mesh, or TP without hpz")
    if config.stage == 3 and frozen:
        raise ValueError(f"stage 3 with tensor parallelism partitions trainable parameters only; {len(frozen)} are "
                         f"frozen (e.g. {frozen[0]!r}): use stage 1-2, or train them")
    if whole_groups:
        raise ValueError("an optimizer that reads whole tensors (here in param group(s) "
                         f"{sorted(whole_groups)}) cannot run on tensor-parallel shards: its update of a DTensor's "
                         "local shard is not its update of the matrix. Use an elementwise optimizer (AdamW, SGD) with TP")
