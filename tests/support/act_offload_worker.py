"""Worker for tests/offload/test_activation_offload*.py: a TinyGPT with dropout trained a few steps
with and without activation offload, on one rank or several; the gradients of every step and
the final weights, bit for bit, and what the offload moved."""
from __future__ import annotations

import contextlib
import copy
import json
import os
import tempfile
from dataclasses import replace
from typing import Any, Optional

import torch
import torch.distributed as dist

import zeroshard
from zeroshard.testing.toy import GPTConfig, TinyGPT, synthetic_batch

from tests.support.live_bytes import LiveBytes

CFG = GPTConfig(vocab=64, d_model=32, n_layers=3, n_heads=4, seq_len=16, dropout=0.1)
BATCH = 4  # global


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def train(stage: int, where: Optional[str], checkpointing: bool, steps: int = 3,
          directory: Optional[str] = None, **offload: Any) -> dict:
    """Gradients of each step and the final weights (tensors, this rank), and the offload's report."""
    cfg = replace(CFG, activation_checkpointing=checkpointing)
    rank, world = _rank_world()
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    options: dict = {}
    if where is not None:
        path = directory or tempfile.mkdtemp(prefix="act-")
        options["offload_activations"] = zeroshard.ActivationOffload(
            where=where, path=path if where == "nvme" else None, min_bytes=1024, **offload)
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1, stage=stage, **options)
    torch.manual_seed(1 + rank)  # (dropout differs by rank, the same with and without offload)
    grads = []
    for step in range(steps):
        x, y = synthetic_batch(step, BATCH, cfg)
        model(x[rank::world], y[rank::world]).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad()
    report = opt.placement_report().get("activations")
    memory = opt.memory_report()
    weights = {n: p.detach().clone() for n, p in zeroshard.full_state_dict(model, rank0_only=False).items()}
    opt.close()
    return {"grads": grads, "weights": weights, "report": report, "memory": memory}


def train_planned(budget: int, directory: Optional[str], planned: bool, steps: int = 8, declared: bool = True,
                  seq_lens: Optional[list[int]] = None, checkpointed: bool = True, prefetch: int = 2,
                  recompute: bool = True, n_layers: int = CFG.n_layers, peaks: bool = False,
                  shape_over: Optional[dict] = None, bucket_size_mb: Optional[float] = None,
                  state_dicts: bool = False, stage: int = 2) -> dict:
    """As ``train`` (stage 2, checkpointed blocks), under offload="auto" with ``memory_budget`` (reserve 0:
    the state's plan does not depend on the process) and, if ``planned``, the activations planned
    with it (``PlannedActivations``: the shape declared, or measured at the first forward); step i
    runs the first ``seq_lens[i]`` tokens of each sequence (default: all), and the plan in force
    after each step is kept. ``directory`` None: no nvme_path; ``shape_over``: GPTConfig fields changed."""
    cfg = replace(CFG, activation_checkpointing=checkpointed, n_layers=n_layers, **(shape_over or {}))
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    shape = {"micro_batch": BATCH, "seq_len": cfg.seq_len} if declared else {}
    extra = {"offload_activations": zeroshard.PlannedActivations(**shape, checkpointed=checkpointed,
                                                                       prefetch=prefetch, recompute=recompute)
             } if planned else {}
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1, stage=stage, offload="auto",
                                  memory_budget={"host": budget, "reserve": 0}, nvme_path=directory, **extra,
                                  **({"bucket_size_mb": bucket_size_mb} if bucket_size_mb else {}))
    torch.manual_seed(1)
    grads, plans, moved, live = [], [], [], []
    try:
        for step in range(steps):
            x, y = synthetic_batch(step, BATCH, cfg)
            n = seq_lens[step] if seq_lens else cfg.seq_len
            with LiveBytes() if peaks else contextlib.nullcontext() as tracked:  # (peaks: the step's live tensor bytes)
                model(x[:, :n], y[:, :n]).backward()
            live.append(tracked.peak if tracked is not None else None)
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
            opt.step()
            opt.zero_grad()
            plans.append((opt.placement_report().get("activations") or {}).get("plan"))
            moved.append((opt.placement_report().get("activations") or {}).get("bytes_moved_last_step"))
        report = opt.placement_report().get("activations")
        joint = opt.placement_report().get("joint")
        state = {k: opt.placement_report()[k] for k in ("units", "applied")}  # (where the state lives)
        saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())) if state_dicts else None
        weights = {n: p.detach().clone() for n, p in model.state_dict().items()}
    finally:
        opt.close()
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    wrapped = sum("forward" in vars(m) for m in model.modules())  # (forwards the offloader wrapped, left)
    return {"grads": grads, "weights": weights, "report": report, "joint": joint, "state": state, "saved": saved,
            "plans": plans,
            "moved": moved, "hooks_left": hooks, "peaks": live,
            "forwards_left": wrapped}


def resumed_planned(budget: int, directory: str, declared: bool, saved: tuple[dict, dict], shape_over: dict,
                    bucket_size_mb: float, stage: int = 2) -> dict:
    """One step of a checkpointed TinyGPT under offload="auto" with ``budget`` (the shape declared or measured)
    from ``saved`` (the model's and the optimizer's state dicts, loaded before the first forward); its
    gradients, weights and state placement (``units``, ``joint``)."""
    cfg = replace(CFG, activation_checkpointing=True, **shape_over)
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    shape = {"micro_batch": BATCH, "seq_len": cfg.seq_len} if declared else {}
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1, stage=stage, offload="auto",
                                  memory_budget={"host": budget, "reserve": 0}, nvme_path=directory,
                                  offload_activations=zeroshard.PlannedActivations(**shape),
                                  bucket_size_mb=bucket_size_mb)
    try:
        model.load_state_dict(saved[0])
        opt.load_state_dict(copy.deepcopy(saved[1]))
        torch.manual_seed(2)
        model(*synthetic_batch(2, BATCH, cfg)).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        report = opt.placement_report()
        return {"grads": grads, "weights": copy.deepcopy(model.state_dict()), "units": report["units"],
                "joint": report["joint"]}
    finally:
        opt.close()


def predicted_bytes(checkpointing: bool, world: int = 1) -> int:
    """Bytes a checkpointed TinyGPT step moves off the device: each block's input (fp32)."""
    tokens = BATCH // world * CFG.seq_len
    return CFG.n_layers * tokens * CFG.d_model * 4


CASES = [(0, "cpu", True), (2, "nvme", False), (3, "nvme", True), (3, "cpu", False)]


def parity_on_ranks(rank: int, world: int, out: str) -> None:
    res: dict = {}
    for stage, where, ckpt in CASES:
        want, got = train(stage, None, ckpt, steps=8), train(stage, where, ckpt, steps=8)
        same_grads = all(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
                         for a, b in zip(got["grads"], want["grads"]))
        same_weights = all(torch.equal(got["weights"][k], want["weights"][k]) for k in want["weights"])
        res[f"{stage}-{where}-{ckpt}"] = {"grads": same_grads, "weights": same_weights,
                                          "moved": got["report"]["bytes_out_last_step"],
                                          "back": got["report"]["bytes_in_last_step"]}
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump(res, f)


def uneven_on_ranks(rank: int, world: int, out: str, directory: str) -> None:
    """Shapes measured at the first forward differ by rank (rank 0: 8 tokens a sequence, rank 1: 16): under a
    budget that holds 16, both train 2 steps under one plan (the 16-token one); under one that holds 8 but
    not 16, both raise at the first forward (Note [one plan on every rank]), neither waits for the other;
    and so does rank 0 when only rank 1's budget cannot hold 16."""
    from zeroshard.offload.activations.planned import least_device, shape_of
    from zeroshard.offload.activations.workload import PlannedActivations
    cfg = replace(CFG, activation_checkpointing=True, n_layers=4)
    seq = 8 if rank == 0 else 16
    big, d = 1 << 30, os.path.join(directory, f"rank{rank}")
    os.makedirs(d, exist_ok=True)

    def run(budget: int, steps: int, declared: bool) -> dict:
        torch.manual_seed(0)
        model = TinyGPT(cfg)
        shape = {"micro_batch": BATCH, "seq_len": cfg.seq_len} if declared else {}
        opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=2, offload="auto",
                                      memory_budget={"host": budget, "reserve": 0}, nvme_path=d,
                                      offload_activations=PlannedActivations(**shape, prefetch=1))
        try:
            for step in range(steps):
                x, y = synthetic_batch(step, BATCH, cfg)
                model(x[:, :seq], y[:, :seq]).backward()
                opt.step()
                opt.zero_grad()
            return {"plan": opt.placement_report()["activations"]["plan"]}
        except ValueError as exc:
            return {"error": str(exc)}
        finally:
            opt.close()
    state = big - run(big, 0, True)["plan"]["memory_left"]["device"]
    least = least_device(shape_of(TinyGPT(cfg), cfg.n_layers),
                         PlannedActivations(micro_batch=BATCH, seq_len=cfg.seq_len, prefetch=1), 4, {"host": 0})
    inp = BATCH * cfg.seq_len * cfg.d_model * 4
    res = {"fits": run(state + least + inp, 2, False), "refused": run(state + least - inp, 2, False),
           "one_refuses": run(big if rank == 0 else state + least - inp, 2, False)}  # (rank 0's budget holds it)
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump(res, f)


if __name__ == "__main__":  # pragma: no cover - a manual run
    print(json.dumps({k: v for k, v in train(2, "nvme", True)["report"].items()}, indent=1))
    os._exit(0)
