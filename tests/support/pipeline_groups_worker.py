"""Rank side of tests/checkpoint/test_pipeline_groups.py: pp 2 x dp 1, stage 0 built with
``[{embedding, lr=1e-5}, {rest}]`` and stage 1 with ``[{rest}]`` (Note [param groups by name]);
one step through torch's 1F1B schedule, a checkpoint, then the loads: the same layout, and one
process with the whole model grouped as saved (and grouped otherwise: refused)."""
from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist

import zeroshard
from tests.support import pipeline_worker as pw
from zeroshard.checkpoint.checkpoint_errors import CheckpointMismatchError

SLOW = 1e-5


def stage_groups(module: torch.nn.Module) -> list[dict]:
    if module.first:
        emb = module.model.embed_tokens.weight
        return [{"params": [emb], "lr": SLOW}, {"params": [p for p in module.parameters() if p is not emb]}]
    return [{"params": list(module.parameters())}]


def build(mesh: Any) -> tuple[pw.StageModule, zeroshard.ZeroOptimizer]:
    pp = mesh["pp"].size()
    rank = mesh.get_local_rank("pp")
    per = pw.LAYERS // pp
    module = pw.StageModule(pw.llama(), rank * per, (rank + 1) * per)
    opt = zeroshard.ZeroOptimizer(stage_groups(module), torch.optim.AdamW, lr=pw.LR, stage=2, mesh=mesh,
                                  module=module)
    return module, opt


def train_one_step(mesh: Any, module: pw.StageModule, opt: zeroshard.ZeroOptimizer) -> None:
    from torch.distributed.pipelining import Schedule1F1B

    from zeroshard.comm.pipeline import PipelineStage
    stage = PipelineStage(module, mesh.get_local_rank("pp"), mesh["pp"].size(), torch.device("cpu"),
                          group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, n_microbatches=pw.MICRO, loss_fn=pw.loss_fn)
    x, y = pw.batch(0)
    schedule.step(x) if module.first else schedule.step(target=y)
    opt.step()
    opt.zero_grad()


def worker(rank: int, world: int, out_path: str, ckpt: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))
    alone = [dist.new_group([r]) for r in range(world)]  # (a collective: every rank makes every group)
    module, opt = build(mesh)
    train_one_step(mesh, module, opt)
    zeroshard.save_checkpoint(ckpt, 1, model=module, optimizer=opt)
    saved = {n: p.detach().clone() for n, p in module.named_parameters()}
    opt.close()
    out: dict[str, Any] = {}
    module, opt = build(mesh)  # the same layout: each stage's groups take their own options
    for g in opt.param_groups:
        g["lr"] = 0.5  # (the load must set them all)
    zeroshard.load_checkpoint(ckpt, model=module, optimizer=opt)
    out["same_layout_lrs"] = [g["lr"] for g in opt.param_groups]
    out["same_layout_equal"] = all(torch.equal(p, saved[n]) for n, p in module.named_parameters())
    opt.close()
    if rank == 0:
        with open(os.path.join(ckpt, "step-00000001", "manifest.json")) as f:
            groups = json.load(f)["manifest"]["param_groups"]
        out["manifest_groups"] = [(len(g["params"]), g["lr"], g["params"][0]) for g in groups]
        out["one_process"] = one_process(ckpt, alone[0])
    dist.barrier()
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump(out, f)


def one_process(ckpt: str, group: Any) -> dict:
    """The whole model in one process, grouped as saved, then in one group (refused with the fix)."""
    model = pw.llama()
    emb = model.model.embed_tokens.weight
    as_saved = [{"params": [emb], "lr": SLOW}, {"params": [p for p in model.parameters() if p is not emb]}]
    opt = zeroshard.ZeroOptimizer(as_saved, torch.optim.AdamW, lr=0.5, stage=1, process_group=group)
    info = zeroshard.load_checkpoint(ckpt, model=model, optimizer=opt)
    out: dict[str, Any] = {"lrs": [g["lr"] for g in opt.param_groups], "step": info["step"]}
    opt.close()
    model = pw.llama()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=0.5, stage=1, process_group=group)
    try:
        zeroshard.load_checkpoint(ckpt, model=model, optimizer=opt)
        out["one_group"] = "loaded"
    except CheckpointMismatchError as exc:
        out["one_group"] = str(exc)
    opt.close()
    return out
