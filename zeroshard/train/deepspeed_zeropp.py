"""DeepSpeed's ZeRO++ keys in a DeepSpeed JSON config, read into zeroshard options.

- ``zero_optimization.zero_quantized_weights: true`` (qwZ) -> ``weight_codec="int8"`` (stage 3's
  gathers, block-wise int8 as DeepSpeed's; refused below stage 3, where DeepSpeed ignores it);
- ``zero_optimization.zero_quantized_gradients: true`` (qgZ) -> ``grad_codec="int4"`` (DeepSpeed's
  all-to-all of int4 gradients; sizes that do not divide the block are padded, never a plain
  reduce-scatter in its place: Note [codec error bounds]);
- ``zero_optimization.zero_hpz_partition_size: k`` (hpZ) -> ``hpz=True`` on a (world / k, k)
  mesh, built by ``hpz_mesh`` where the optimizer is built (1: off, as in DeepSpeed).

``false`` and 1 are accepted and change nothing; a partition size > 1 below stage 3, or one
that does not divide the world into several nodes, is reported as unsupported by name. (Before:
all three keys were refused as unsupported.)
"""
from __future__ import annotations

from typing import Callable, Optional, Union

import torch
import torch.distributed as dist

_KEYS = ("zero_quantized_weights", "zero_quantized_gradients", "zero_hpz_partition_size")


def zeropp_options(get: Callable[[str, object], object], unmark: Callable[[str], None], world_size: int,
                   stage: int) -> tuple[dict, Optional[int]]:
    """(ZeroOptimizer options, hpZ partition size or None) from the config; ``get(path, default)``
    reads a key and marks it used, ``unmark(path)`` leaves it to be reported as unsupported: an
    hpZ partition below stage 3 (DeepSpeed's hpZ is stage 3's) or one that does not divide the world."""
    out: dict[str, Union[str, bool]] = {}
    for key, codec_key, codec in (("zero_quantized_weights", "weight_codec", "int8"),
                                  ("zero_quantized_gradients", "grad_codec", "int4")):
        value = get(f"zero_optimization.{key}", False)
        if not isinstance(value, bool):
            raise ValueError(f"zero_optimization.{key}={value!r} must be true or false")
        if value:
            out[codec_key] = codec
    k = get("zero_optimization.zero_hpz_partition_size", 1)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"zero_optimization.zero_hpz_partition_size={k!r} must be an int >= 1 (ranks per node; "
                         "1: hpZ off)")
    if k == 1:
        return out, None
    if stage != 3 or world_size % k or world_size == k:
        unmark("zero_optimization.zero_hpz_partition_size")
        return out, None
    out["hpz"] = True
    return out, k


def hpz_mesh(partition_size: Optional[int], process_group: object = None) -> Optional[object]:
    """The (nodes, ranks per node) DeviceMesh hpZ runs on, for ``zero_hpz_partition_size``."""
    if partition_size is None:
        return None
    if process_group is not None:
        raise ValueError("zero_hpz_partition_size spans every rank (hpZ's mesh); it does not combine with "
                         "process_group=")
    from torch.distributed.device_mesh import init_device_mesh
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(device, (world // partition_size, partition_size), mesh_dim_names=("inter", "intra"))
