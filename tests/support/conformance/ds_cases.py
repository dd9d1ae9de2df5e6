"""Ported from DeepSpeed's tests/unit/runtime/zero and tests/unit/checkpoint; see tests/support/conformance/cases.py."""
from __future__ import annotations

import os

import torch
from torch import nn

import zeroshard
from tests.support.conformance.common import GLOBAL, _close, _full, _local, _pair, _shared_dir, _step_both, case
from tests.support.models import TinyNet, batch


# -- ds: tests/unit/runtime/zero, tests/unit/checkpoint ----------------------------------------
class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)) for _ in range(3)])
        self.out = nn.Linear(8, 1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.inp(torch.nn.functional.one_hot(tokens % 6, 6).to(self.out.weight.dtype)).mean(1)
        for b in self.blocks:
            h = torch.tanh(b(h))
        h = self.blocks[0](h)  # a unit used twice in one forward
        return self.out(h).float().pow(2).mean()


@case("ds: TestZero3RepeatForwardLoop / TestZeroUnbalancedGradients (stage 3, unit called twice)")
def ds_stage3_repeat_forward(rank: int, world: int) -> None:
    model, ref = _pair(cls=_Blocks)
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=3)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(3):
        _step_both(model, opt, ref, ropt, step, rank, world)
    _close(model, ref, 3)


@case("ds: TestZeroAdamOptimizerStepCount (every parameter's step equals the steps taken)")
def ds_step_count(rank: int, world: int) -> None:
    for stage in (1, 2, 3):
        model, ref = _pair(cls=_Blocks)
        opt = zeroshard.ZeroOptimizer(model, torch.optim.Adam, lr=1e-2, stage=stage)
        ropt = torch.optim.Adam(ref.parameters(), lr=1e-2)
        for step in range(3):
            _step_both(model, opt, ref, ropt, step, rank, world)
        steps = {float(st["step"]) for p in model.parameters() for st in [opt.state[p]] if st}
        if steps != {3.0}:
            raise AssertionError(f"stage {stage}: step counts {steps}")


@case("ds: test_zero_grad_clip / TestZeroGradAccum (clipping and accumulation match one big batch)")
def ds_clip_and_accumulation(rank: int, world: int) -> None:
    for stage in (1, 2, 3):
        model, ref = _pair(cls=_Blocks)
        opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=stage)
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        for step in range(2):
            x = _local(batch(step, GLOBAL), rank, world)
            opt.zero_grad()
            for half in x.chunk(2):
                (model(half) / 2).backward()
            norm = opt.clip_grad_norm_(0.05)
            opt.step()
            ropt.zero_grad()
            xs = batch(step, GLOBAL)
            (sum(ref(_local(xs, r, world)[i::1].chunk(2)[c]) / 2 for r in range(world) for c in range(2)
                 for i in [0]) / world).backward()
            rnorm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
            ropt.step()
            if abs(norm.item() - rnorm.item()) > 1e-4 * max(1.0, rnorm.item()):
                raise AssertionError(f"stage {stage}: norm {norm.item()} vs {rnorm.item()}")
        _close(model, ref, stage)


@case("ds: TestZeroFrozenWeights / TestZeroOffloadStage1 (frozen layers, cpu offload)")
def ds_frozen_and_offload(rank: int, world: int) -> None:
    for offload in (None, "cpu"):
        model, ref = _pair()  # TinyNet has a frozen layer
        opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=2, offload_optimizer=offload)
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        for step in range(2):
            _step_both(model, opt, ref, ropt, step, rank, world)
        _close(model, ref)


@case("ds: TestZeroEmptyParameterGroup (a param group with no trainable parameter)")
def ds_empty_param_group(rank: int, world: int) -> None:
    model, ref = _pair()
    frozen = list(model.frozen.parameters())
    rest = [p for p in model.parameters() if p.requires_grad]
    opt = zeroshard.ZeroOptimizer([{"params": rest}, {"params": frozen, "lr": 0.5}], torch.optim.Adam,
                                  lr=1e-2, stage=2)
    ropt = torch.optim.Adam([{"params": [p for p in ref.parameters() if p.requires_grad]},
                             {"params": list(ref.frozen.parameters()), "lr": 0.5}], lr=1e-2)
    for step in range(2):
        _step_both(model, opt, ref, ropt, step, rank, world)
    _close(model, ref)


@case("ds: test_checkpoint_zero_optimizer / test_checkpoint_lr_scheduler / test_latest_checkpoint")
def ds_checkpoint_resume(rank: int, world: int) -> None:
    root = os.path.join(_shared_dir(rank), "ck")
    model, ref = _pair()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, stage=2, mixed_precision="bf16")
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9)
    for step in range(2):
        model(_local(batch(step, GLOBAL), rank, world)).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    zeroshard.save_checkpoint(root, 2, model=model, optimizer=opt, scheduler=sched)
    other, _ = _pair(seed=5)
    o2 = zeroshard.ZeroOptimizer(other, torch.optim.AdamW, lr=1e-2, stage=2, mixed_precision="bf16")
    s2 = torch.optim.lr_scheduler.StepLR(o2, 1, gamma=0.9)
    info = zeroshard.load_checkpoint(root, model=other, optimizer=o2, scheduler=s2)
    if info["step"] != 2 or s2.state_dict()["last_epoch"] != sched.state_dict()["last_epoch"]:
        raise AssertionError(f"resume info {info}")
    for m, o in ((model, opt), (other, o2)):
        m(_local(batch(2, GLOBAL), rank, world)).backward()
        o.step()
    for a, b in zip(model.parameters(), other.parameters()):
        if not torch.equal(a, b):
            raise AssertionError("resumed training differs")


@case("ds: test_checkpoint_zero_elastic / test_universal_checkpoint (reshard world and stage)")
def ds_checkpoint_elastic(rank: int, world: int) -> None:
    root = os.path.join(_shared_dir(rank), "ck")
    model, _ = _pair()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.Adam, lr=1e-2, stage=1)
    model(_local(batch(0, GLOBAL), rank, world)).backward()
    opt.step()
    zeroshard.save_checkpoint(root, 1, model=model, optimizer=opt)
    full = opt.consolidated_state_dict(to_rank=None)
    other = TinyNet()
    o2 = zeroshard.ZeroOptimizer(other, torch.optim.Adam, lr=1e-2, stage=3)  # other stage, same world
    zeroshard.load_checkpoint(root, model=other, optimizer=o2)
    again = o2.consolidated_state_dict(to_rank=None)
    for i, st in full["state"].items():
        if not torch.allclose(st["exp_avg"], again["state"][i]["exp_avg"]):
            raise AssertionError(f"param {i}: exp_avg differs after resharding")


@case("ds: test_checkpoint_zero_no_optimizer / TestZeroToFP32 (weights only, consolidated fp32)")
def ds_weights_only(rank: int, world: int) -> None:
    root = os.path.join(_shared_dir(rank), "ck")
    model, _ = _pair(cls=_Blocks)
    opt = zeroshard.ZeroOptimizer(model, torch.optim.Adam, lr=1e-2, stage=3, mixed_precision="bf16")
    model(_local(batch(0, GLOBAL), rank, world)).backward()
    opt.step()
    zeroshard.save_checkpoint(root, 1, model=model, optimizer=opt)
    fp32 = _full(model, 3)
    plain = _Blocks()
    zeroshard.load_checkpoint(root, model=plain, optimizer=None)
    for k, v in plain.state_dict().items():
        if (v.float() - fp32[k]).abs().max() > 1e-2:  # bf16 model copy vs fp32 masters
            raise AssertionError(k)


@case("ds: TestZero3DictFwd (stage 3 forward returning a dict)")
def ds_dict_forward(rank: int, world: int) -> None:
    class DictOut(_Blocks):
        def forward(self, tokens):
            return {"loss": super().forward(tokens), "aux": torch.zeros(())}
    model, ref = _pair(cls=DictOut)
    opt = zeroshard.ZeroOptimizer(model, torch.optim.SGD, lr=0.1, stage=3)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = batch(0, GLOBAL)
    model(_local(x, rank, world))["loss"].backward()
    opt.step()
    (sum(ref(_local(x, r, world))["loss"] for r in range(world)) / world).backward()
    ropt.step()
    _close(model, ref, 3)


@case("ds: test_zero_tensor_fragment safe_get_full_optimizer_state (read-only per-parameter view)")
def ds_tensor_fragment(rank: int, world: int) -> None:
    model, ref = _pair()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.Adam, lr=1e-2, stage=2)
    ropt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    _step_both(model, opt, ref, ropt, 0, rank, world)
    full = opt.consolidated_state_dict(to_rank=None)
    names = [n for n, p in model.named_parameters()]
    rstate = ropt.state_dict()["state"]
    for i, n in enumerate(names):
        if i in rstate and not torch.allclose(full["state"][i]["exp_avg"], rstate[i]["exp_avg"], atol=1e-6):
            raise AssertionError(f"{n}: consolidated exp_avg differs")


@case("ds: TestZeroStage3ParamGroups (no weight decay on biases and norms at stage 3)")
def ds_stage3_param_groups(rank: int, world: int) -> None:
    def groups(m):
        return [{"params": [p for p in m.parameters() if p.dim() >= 2], "weight_decay": 0.1},
                {"params": [p for p in m.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    model, ref = _pair(cls=_Blocks)
    opt = zeroshard.ZeroOptimizer(groups(model), torch.optim.AdamW, lr=1e-2, stage=3, module=model)
    ropt = torch.optim.AdamW(groups(ref), lr=1e-2)
    for step in range(2):
        _step_both(model, opt, ref, ropt, step, rank, world)
    _close(model, ref, 3)
