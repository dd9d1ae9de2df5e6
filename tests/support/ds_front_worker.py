"""Rank side of tests/train/test_deepspeed_front.py: one DeepSpeed-style script, run by the real
DeepSpeed (CPU, gloo, ``torch_adam``) and by ``import zeroshard as deepspeed``, stages 0-3.

``script`` is written as a DeepSpeed user writes it (engine, accumulation 2, clipping, WarmupLR,
save/load with client_state); the library is its argument. Data: one global batch per
micro-step from a seeded generator, each rank taking its slice, so every world size sees the
same global batches (a world of one takes the whole batch as its micro-batch).
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional

import torch
import torch.distributed as dist

GLOBAL_MICRO = 8  # samples per micro-step, all ranks together
ACCUM = 2
FIRST, THEN = 3, 2  # optimizer steps before the checkpoint, and after it
STAGES = (0, 1, 2, 3)
CONVERT_STAGES = (2, 3)


def config(stage: int, world: int) -> dict:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": GLOBAL_MICRO // world, "gradient_accumulation_steps": ACCUM,
        "gradient_clipping": 0.3,
        "optimizer": {"type": "Adam", "params": {"lr": 2e-2, "betas": [0.9, 0.99], "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 2e-3, "warmup_max_lr": 2e-2,
                                                     "warmup_num_steps": 4, "warmup_type": "linear"}},
        "zero_optimization": {"stage": stage},
    }
    if stage != 1:  # stage 1 keeps torch's AdamW default weight decay (0.01), as DeepSpeed's torch_adam does
        cfg["optimizer"]["params"]["weight_decay"] = 0.05
    return cfg


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 4))


def batch(micro: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + micro)
    x, y = torch.randn(GLOBAL_MICRO, 8, generator=g), torch.randn(GLOBAL_MICRO, 4, generator=g)
    n = GLOBAL_MICRO // world
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def script(deepspeed: Any, stage: int, steps: int, save_dir: Optional[str] = None, save_at: int = 0,
           load_dir: Optional[str] = None) -> dict:
    """The user's training script: ``steps`` optimizer steps, a checkpoint after ``save_at`` of
    them. Returns the full weights, learning rates, norms, the client state it loaded."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                           config=config(stage, world))
    micro, client = 0, None
    if load_dir is not None:
        _, client = engine.load_checkpoint(load_dir)
        client = {k: client[k] for k in ("micro", "note")}  # (DeepSpeed's holds its own entries too)
        micro = client["micro"]
    lrs, norms = [], []
    for _ in range(steps * engine.gradient_accumulation_steps()):
        x, y = batch(micro, rank, world)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()
        micro += 1
        if boundary:
            lrs.append(float(engine.get_lr()[0]))
            norm = engine.get_global_grad_norm()  # (DeepSpeed's stage 0 does not measure it: None)
            norms.append(None if norm is None else float(norm))
            if save_dir is not None and len(lrs) == save_at:
                engine.save_checkpoint(save_dir, client_state={"micro": micro, "note": "from the script"})
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        weights = {n: p.detach().clone().tolist() for n, p in model.named_parameters()}
    return {"weights": weights, "lrs": lrs, "norms": norms, "global_steps": engine.global_steps,
            "client": client}


def _run_all(deepspeed: Any, out: str, tag: str) -> dict:
    """Per stage: FIRST + THEN steps with a checkpoint after FIRST; a fresh engine resumed from
    the checkpoint runs the same THEN steps."""
    results = {}
    for stage in STAGES:
        ckpt = os.path.join(out, f"{tag}-w{dist.get_world_size()}-stage{stage}")
        straight = script(deepspeed, stage, FIRST + THEN, save_dir=ckpt, save_at=FIRST)
        resumed = script(deepspeed, stage, THEN, load_dir=ckpt)
        results[stage] = {"straight": straight, "resumed": resumed}
    return results


def gathered_checks(stage: int) -> dict:
    """``deepspeed.zero.GatheredParameters`` on zeroshard: full shapes inside the block, the
    modifier rank's write on every rank after it (and trained from), other writes discarded."""
    import zeroshard as deepspeed
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model()
    engine, _, _, _ = deepspeed.initialize(model=model, config=config(stage, world))
    with deepspeed.zero.GatheredParameters(model[0].weight):
        shape = list(model[0].weight.shape)
        model[0].weight.data.fill_(7.0)  # no modifier_rank: discarded
    with deepspeed.zero.GatheredParameters([model[0].weight, model[2].bias], modifier_rank=world - 1):
        if rank == world - 1:
            model[0].weight.data.fill_(0.25)
            model[2].bias.data.fill_(-1.0)
    after = deepspeed.full_state_dict(model, rank0_only=False)
    x, y = batch(0, rank, world)
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    engine.step()  # (accumulation 2: no optimizer step yet)
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    engine.step()
    trained = deepspeed.full_state_dict(model, rank0_only=False)
    return {"shape": shape, "w0": sorted(set(after["0.weight"].flatten().tolist())),
            "b2": sorted(set(after["2.bias"].flatten().tolist())),
            "w4_unchanged": bool(torch.equal(after["4.weight"], make_model().state_dict()["4.weight"])),
            "moved_from_0.25": float((trained["0.weight"] - 0.25).abs().max())}


def convert_and_resume(out: str) -> dict:
    """The checkpoints real DeepSpeed wrote at stages 2-3 on 2 ranks (``_run_all``), converted
    (rank 0, in a group of its own; the world-1 run reuses them) and resumed by zeroshard."""
    import zeroshard
    from zeroshard.deepspeed_compat.convert import convert_deepspeed
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    alone = [dist.new_group([r]) for r in range(world)]  # (a collective: every rank creates every group)
    for stage in CONVERT_STAGES:
        converted = os.path.join(out, f"converted-stage{stage}")
        if world == 2 and rank == 0:
            convert_deepspeed(os.path.join(out, f"ds-w2-stage{stage}"), converted, process_group=alone[0])
        dist.barrier()
        results[stage] = script(zeroshard, stage, THEN, load_dir=converted)
    return results


def ds_bf16_variant(deepspeed: Any, out: str, stage: int) -> dict:
    """Real DeepSpeed, bf16, a frozen weight and two param groups: a checkpoint, and
    DeepSpeed's own fp32 reconstruction of it (zero_to_fp32) for the converter to match."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    model = make_model()
    model[0].bias.requires_grad_(False)
    groups = [{"params": [model[0].weight, model[2].weight, model[4].weight]},
              {"params": [model[2].bias, model[4].bias], "weight_decay": 0.0}]
    cfg = {**config(stage, dist.get_world_size()), "bf16": {"enabled": True}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=cfg)
    for micro in range(2 * ACCUM):
        x, y = batch(micro, dist.get_rank(), dist.get_world_size())
        engine.backward(torch.nn.functional.mse_loss(engine(x.bfloat16()).float(), y))
        engine.step()
    path = os.path.join(out, f"ds-w2-bf16-stage{stage}")
    engine.save_checkpoint(path)
    dist.barrier()
    fp32 = get_fp32_state_dict_from_zero_checkpoint(path) if dist.get_rank() == 0 else {}
    return {n: t.float().tolist() for n, t in fp32.items()}


def run(rank: int, world: int, out: str, with_deepspeed: bool) -> None:
    import zeroshard
    results: dict[str, Any] = {"zeroshard": _run_all(zeroshard, out, "zs"),
                               "gathered": {stage: gathered_checks(stage) for stage in (2, 3)}}
    if with_deepspeed:
        os.environ["DS_ACCELERATOR"] = "cpu"
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo")
        results["deepspeed"] = _run_all(deepspeed, out, "ds")
        if world == 2:
            results["bf16_fp32"] = {stage: ds_bf16_variant(deepspeed, out, stage) for stage in CONVERT_STAGES}
        results["converted"] = convert_and_resume(out)
    with open(os.path.join(out, f"results-w{world}-r{rank}.json"), "w") as f:
        json.dump(results, f)
