"""Rank side of the DeepSpeed-config parity test: ``zeroshard.initialize(model, ds_config)``
against the same run written with ZeroOptimizer arguments and a schedule by hand."""
from __future__ import annotations

import json
from typing import Any, Callable

import torch

import zeroshard
from zeroshard.testing.toy import GPTConfig, TinyGPT, synthetic_batch
from zeroshard.train.schedules import WarmupCosineLR, WarmupDecayLR, WarmupLR

STEPS = 8
GLOBAL = 8
MODEL = GPTConfig(vocab=64, d_model=32, n_layers=2, n_heads=4, seq_len=8, dropout=0.1)

# name -> (DeepSpeed config, the equivalent by hand: (model) -> (optimizer, scheduler), clip, accumulation)
CASES: dict[str, tuple[dict, Callable[[Any], tuple], float, int]] = {
    "stage2-adamw-cosine": (
        {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
         "zero_optimization": {"stage": 2, "reduce_bucket_size": 4096, "overlap_comm": True},
         "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
         "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": STEPS, "warmup_num_steps": 3,
                                                            "warmup_type": "linear", "cos_min_ratio": 0.1}}},
        lambda m: _pair(zeroshard.ZeroOptimizer(m, torch.optim.AdamW, stage=2, bucket_size_mb=4096 * 4 / 2**20,
                                                lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1),
                        lambda o: WarmupCosineLR(o, STEPS, warmup_num_steps=3, warmup_type="linear",
                                                 cos_min_ratio=0.1)),
        0.5, 2),
    # DeepSpeed's "Adam" with adam_w_mode false is torch's Adam (L2 weight decay); bf16 training.
    "stage1-adam-bf16-decay": (
        {"train_batch_size": 8, "zero_optimization": {"stage": 1}, "bf16": {"enabled": True},
         "optimizer": {"type": "Adam", "params": {"lr": 2e-3, "adam_w_mode": False, "weight_decay": 0.01}},
         "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": STEPS, "warmup_max_lr": 2e-3,
                                                           "warmup_num_steps": 4}}},
        lambda m: _pair(zeroshard.ZeroOptimizer(m, torch.optim.Adam, stage=1, mixed_precision="bf16", lr=2e-3,
                                                weight_decay=0.01),
                        lambda o: WarmupDecayLR(o, STEPS, warmup_max_lr=2e-3, warmup_num_steps=4)),
        0.0, 1),
    "stage3-sgd-warmup": (
        {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e9},
         "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
         "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.01, "warmup_max_lr": 0.05,
                                                      "warmup_num_steps": 5}}},
        lambda m: _pair(zeroshard.ZeroOptimizer(m, torch.optim.SGD, stage=3, lr=0.05, momentum=0.9),
                        lambda o: WarmupLR(o, warmup_min_lr=0.01, warmup_max_lr=0.05, warmup_num_steps=5)),
        0.0, 1),
}


def _pair(opt, make_sched):
    return opt, make_sched(opt)


def _train(model, opt, sched, clip: float, accum: int, rank: int, world: int) -> list[float]:
    local = GLOBAL // world
    micro = local // accum
    lrs = []
    for step in range(STEPS):
        x, y = synthetic_batch(step, GLOBAL, MODEL)
        x, y = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
        for k in range(accum):
            opt.backward(model(x[k * micro:(k + 1) * micro], y[k * micro:(k + 1) * micro]) / accum)
        if clip:
            opt.clip_grad_norm_(clip)
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        opt.zero_grad()
    return lrs


def _params(model) -> dict[str, str]:
    state = zeroshard.full_state_dict(model, rank0_only=False)
    return {n: t.contiguous().view(-1).view(torch.uint8).numpy().tobytes().hex() for n, t in state.items()}


def run(rank: int, world: int, out: str) -> None:
    results = {}
    for name, (config, by_hand, clip, accum) in CASES.items():
        torch.manual_seed(0)
        model = TinyGPT(MODEL)
        init = zeroshard.initialize(model, config)
        _, opt, sched = init
        plan = init.plan
        lrs_ds = _train(model, opt, sched, plan.gradient_clipping or 0.0, plan.gradient_accumulation_steps, rank, world)
        ds = _params(model)
        torch.manual_seed(0)
        model = TinyGPT(MODEL)
        opt, sched = by_hand(model)
        lrs_hand = _train(model, opt, sched, clip, accum, rank, world)
        results[name] = {"same_params": ds == _params(model), "lrs_ds": lrs_ds, "lrs_hand": lrs_hand,
                         "plan": {"clip": plan.gradient_clipping, "accum": plan.gradient_accumulation_steps,
                                  "micro": plan.micro_batch_size}}
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump(results, f)
