"""Spawned 2-rank cases of tests/unit/test_construction_refusals.py: DistributedDataParallel kept around a
model a ZeroOptimizer manages (nanoGPT's pattern: DDP applied after the optimizer, or the
optimizer built over the DDP), and ZeroCallback under a Trainer whose world is larger than the
optimizer's."""
from __future__ import annotations

import os
from typing import Callable

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import zeroshard
from tests.support.models import FrozenBaseNet

A = torch.optim.AdamW
FIX = "pass model.module"


def _refused(fn: Callable[[], object], where: str) -> None:
    with pytest.raises(RuntimeError, match=FIX) as info:
        fn()
    assert "DistributedDataParallel" in str(info.value), (where, info.value)


def _train_once(model, opt) -> None:
    model(torch.randn(3, 8)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def ddp_and_callback(rank: int, world: int, out: str) -> None:
    x = torch.randn(3, 8)
    for stage in (2, 3):
        # nanoGPT: the optimizer over the raw model, then model = DDP(model)
        model = FrozenBaseNet()
        opt = zeroshard.ZeroOptimizer(model, A, lr=1e-2, stage=stage)
        try:
            ddp = DDP(model)
        except RuntimeError as exc:  # (refused at once: as good)
            assert FIX in str(exc), exc
        else:
            _refused(lambda: ddp(x).sum().backward(), f"stage {stage}: DDP after the optimizer")
            ddp = None  # (drops the DDP)
        opt.close()
        _train_once(model, zeroshard.ZeroOptimizer(model, A, lr=1e-2, stage=stage))  # works without DDP
        # the optimizer over a DDP-wrapped model, or over the model a DDP wraps
        wrapped = DDP(FrozenBaseNet())
        _refused(lambda: zeroshard.ZeroOptimizer(wrapped, A, lr=1e-2, stage=stage), f"stage {stage}: over DDP")
        opt = zeroshard.ZeroOptimizer(wrapped.module, A, lr=1e-2, stage=stage)  # DDP built before
        _refused(lambda: wrapped(x).sum().backward(), f"stage {stage}: over the module a DDP wraps")
        opt.close()
        wrapped = None  # (drops the DDP)
    # param groups (no module): a DDP over them is seen at the first backward
    for before in (False, True):
        model = FrozenBaseNet()
        ddp = DDP(model) if before else None
        opt = zeroshard.ZeroOptimizer([p for p in model.parameters() if p.requires_grad], A, lr=1e-2, stage=2)
        ddp = ddp or DDP(model)
        _refused(lambda: ddp(x).sum().backward(), f"param list, DDP {'before' if before else 'after'}")
        ddp = None  # (drops the DDP)
        opt.close()

    # ZeroCallback: the Trainer's world (every process) against the optimizer's (here one rank)
    from transformers import TrainerControl, TrainerState, TrainingArguments
    from zeroshard.integrations.transformers import ZeroCallback
    alone = [dist.new_group([r]) for r in range(world)][rank]
    model = FrozenBaseNet()
    opt = zeroshard.ZeroOptimizer(model, A, lr=1e-2, stage=2, process_group=alone)
    args = TrainingArguments(output_dir=os.path.join(out, f"trainer{rank}"), report_to=[], use_cpu=True)
    assert args.world_size == world
    with pytest.raises(RuntimeError, match=r"world_size=2 processes but the ZeroOptimizer spans 1 rank"):
        ZeroCallback().on_init_end(args, TrainerState(), TrainerControl(), model=model, optimizer=opt)
    full = zeroshard.ZeroOptimizer(FrozenBaseNet(), A, lr=1e-2, stage=2)
    ZeroCallback().on_init_end(args, TrainerState(), TrainerControl(), model=full.engine.module, optimizer=full)
    dist.barrier()
    open(os.path.join(out, f"rank{rank}.ok"), "w").close()
