"""2 gloo ranks: a refusal on one rank reaches every rank as the same clear error (issue 43).

Each case runs on both ranks and records what each rank saw, so tests/test_rank_agreement.py
can check that both ranks raised the same error (and that the ranks are still in step after
it: every case ends with a collective that would fail or hang otherwise).
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

import zeroshard
from tests.models import TinyNet, batch


def _outcome(fn: Callable[[], Any]) -> dict:
    try:
        fn()
        return {"raised": None}
    except Exception as exc:  # noqa: BLE001 - recorded for the test to judge
        return {"raised": type(exc).__name__, "message": str(exc)}


def _in_step() -> bool:
    """Both ranks reach this collective (a rank left behind in another one would mismatch it)."""
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    return float(t) == 3.0


def construction_case(root: str) -> dict:
    """Rank 1's nvme_path is a regular file (per-node paths differ); rank 0's is a directory."""
    rank = dist.get_rank()
    path = os.path.join(root, f"swap-{rank}")
    if rank == 1:
        open(path, "w").close()
    else:
        os.makedirs(path, exist_ok=True)
    torch.manual_seed(0)
    model = TinyNet()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    def build() -> None:
        zeroshard.ZeroOptimizer(model, torch.optim.AdamW, stage=2, lr=1e-2, offload_optimizer="nvme",
                                nvme_path=path)
    out = _outcome(build)
    out["model_restored"] = all(torch.equal(before[n], p) for n, p in model.named_parameters())
    out["in_step"] = _in_step()
    return out


def pipeline_case() -> dict:
    """PipelineStage(num_stages=3) on a pp=2 mesh: refused as it is built, with and without a
    ZeroOptimizer on the stage module."""
    from torch.distributed.device_mesh import init_device_mesh

    from zeroshard.comm.pipeline import PipelineStage
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))
    pp = mesh["pp"]
    out = {}
    for with_opt in (False, True):
        module = nn.Sequential(nn.Linear(8, 8))
        opt = zeroshard.ZeroOptimizer(module, torch.optim.AdamW, lr=1e-2, stage=2, mesh=mesh) if with_opt else None
        out["with_optimizer" if with_opt else "plain"] = _outcome(
            lambda: PipelineStage(module, pp.get_local_rank(), 3, torch.device("cpu"), group=pp.get_group()))
        if opt is not None:
            opt.close()
    out["in_step"] = _in_step()
    return out


def worker(rank: int, world: int, out_path: str, root: str) -> None:
    out = {"construction": construction_case(root), "pipeline": pipeline_case()}
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump(out, f)
