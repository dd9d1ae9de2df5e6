"""2 gloo ranks: a refusal on one rank reaches every rank as the same clear error (issue 43).

Each case runs on both ranks and records what each rank saw, so tests/dist/test_rank_agreement.py
can check that both ranks raised the same error (and that the ranks are still in step after
it: every case ends with a collective that would fail or hang otherwise).
"""
from __future__ import annotations

import copy
import json
import os
import time
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

import zeroshard
from tests.support.models import TinyNet, batch


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


def _trained(stage: int) -> tuple[nn.Module, zeroshard.ZeroOptimizer]:
    torch.manual_seed(0)
    model = TinyNet()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, stage=stage, lr=1e-2)
    model(batch(dist.get_rank(), 4)).backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _save_warns(obj: Any, path: str) -> list[str]:
    """torch.save(obj, path): the ShardOnlySaveWarning messages it gave."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.save(obj, path)
    return [str(w.message) for w in seen if issubclass(w.category, zeroshard.ShardOnlySaveWarning)]


def save_case(root: str, stage: int) -> dict:
    """nanoGPT's rank-0-only torch.save(opt.state_dict()) is told at save time; the legitimate
    forms (every rank its own file, a consolidated dict on rank 0, an in-memory copy) say nothing
    and load back."""
    rank = dist.get_rank()
    model, opt = _trained(stage)
    out: dict[str, Any] = {}
    if rank == 0:
        out["rank0_only_warned"] = _save_warns(opt.state_dict(), os.path.join(root, f"s{stage}-rank0-only.pt"))
    dist.barrier()
    own = os.path.join(root, f"s{stage}-own-{rank}.pt")
    out["own_file_warned"] = _save_warns(opt.state_dict(), own)
    out["own_file_loads"] = _outcome(lambda: opt.load_state_dict(torch.load(own, weights_only=True)))
    full = opt.consolidated_state_dict()
    if rank == 0:
        out["consolidated_warned"] = _save_warns(full, os.path.join(root, f"s{stage}-full.pt"))
    out["deepcopy_loads"] = _outcome(lambda: opt.load_state_dict(copy.deepcopy(opt.state_dict())))
    out["in_step"] = _in_step()
    opt.close()
    return out


def ddp_idiom_case(root: str, stage: int) -> dict:
    """The DDP idiom: rank 0 torch.saves {model, optimizer}.state_dict(), a barrier, every rank
    loads: both ranks must refuse the optimizer's state with the same clear error."""
    model, opt = _trained(stage)
    path = os.path.join(root, f"ddp-idiom-s{stage}.pt")
    if dist.get_rank() == 0:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", zeroshard.ShardOnlySaveWarning)
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)  # (stage 3: warns, not raises)
    dist.barrier()

    def load() -> None:
        ckpt = torch.load(path, weights_only=True)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
    out = _outcome(load)
    out["in_step"] = _in_step()
    opt.close()
    return out


def worker(rank: int, world: int, out_path: str, root: str) -> None:
    os.environ["ZEROSHARD_SAVE_AGREE_S"] = "2"  # (how long a save waits for its peers' saves)
    out = {"construction": construction_case(root), "pipeline": pipeline_case(),
           "save": {str(s): save_case(root, s) for s in (1, 2, 3)}, "ddp_idiom": ddp_idiom_case(root, 2), "ddp_idiom_stage3": ddp_idiom_case(root, 3)}
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump(out, f)


def divergence_worker(rank: int, world: int, out_path: str, root: str) -> None:
    """Stage 3, nanoGPT's estimate_loss under master_process: rank 0 evaluates alone while rank 1
    trains on. With a 2 s bound both ranks raise the same error within seconds, whatever the
    group's timeout. The ranks have diverged for good (rank 1's gather is still in flight), so
    the process ends without finalization once its result is written."""
    os.environ["ZEROSHARD_DIVERGENCE_S"] = "2"
    torch.manual_seed(0)
    model = TinyNet()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, stage=3, lr=1e-2)
    model(batch(rank, 4)).backward()
    opt.step()
    opt.zero_grad()
    start = time.monotonic()
    if rank == 0:
        def evaluate() -> None:
            with torch.no_grad():
                model(batch(100, 4))
        out = _outcome(evaluate)
    else:
        out = _outcome(lambda: model(batch(1, 4)).backward())
    out["seconds"] = time.monotonic() - start
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump(out, f)
    os._exit(0)
