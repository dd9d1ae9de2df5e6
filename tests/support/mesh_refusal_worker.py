"""Runs inside each of 2 gloo ranks: the meshes ZeroOptimizer must refuse or read by name
(Note [hybrid sharding] in zeroshard/comm/mesh.py). Writes per-rank results as JSON for
tests/checkpoint/test_frozen_base_checks_and_lean_saves.py."""
from __future__ import annotations

import json
from typing import Any, Callable

import torch

import zeroshard


def _attempt(out: dict, key: str, build: Callable[[], Any]) -> None:
    try:
        build()
        out[key] = "accepted"
    except Exception as exc:  # noqa: BLE001 - the test reads the type and message
        out[key] = f"{type(exc).__name__}: {exc}"


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 4)


def mesh_worker(rank: int, world: int, out_path: str) -> None:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    out: dict = {}
    before = _model().weight.detach().clone()
    # dp 1 x tp 2 and no DTensor: each tp rank would train (and save as "rank 0") its own copy
    model = _model()
    tp = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    _attempt(out, "tp_without_dtensors", lambda: zeroshard.ZeroOptimizer(model, torch.optim.AdamW, stage=1, mesh=tp))
    out["model_intact"] = torch.equal(model.weight.detach(), before)
    # a mesh of rank 0 only, built on every rank
    _attempt(out, "not_my_mesh", lambda: zeroshard.ZeroOptimizer(_model(), torch.optim.AdamW, stage=1,
                                                                 mesh=DeviceMesh("cpu", [0])))
    # (shard, replicate) in that order: read by name, not by position
    reversed_mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp_shard", "dp_replicate"))

    def by_name() -> None:
        opt = zeroshard.ZeroOptimizer(_model(), torch.optim.AdamW, stage=1, mesh=reversed_mesh)
        out["by_name"] = [opt.engine.comm.world_size, opt.engine.replicas.world_size if opt.engine.replicas is not None else None,
                          opt.engine.shard_group_ranks]
    _attempt(out, "reversed", by_name)
    unknown = init_device_mesh("cpu", (1, 2), mesh_dim_names=("ep", "dp"))  # (expert parallelism: not read)
    _attempt(out, "unknown_names", lambda: zeroshard.ZeroOptimizer(_model(), torch.optim.AdamW, stage=1, mesh=unknown))
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump(out, f)
