"""Runs inside each of 4 gloo ranks acting as 2 nodes x 2: ZeRO++ hpZ at stage 3 against
single-process torch.optim.AdamW, a bitwise resume under hpZ, and the bytes each sharding
scope (flat, hybrid, hpZ) moves per step, phase by phase, for tests/dist/test_hpz.py."""
from __future__ import annotations

import json
from typing import Any

import torch

import zeroshard
from tests.support.dropin_worker import GLOBAL_BATCH, MAX_NORM, STEPS, gpt2, tokens, train, weights

NODES, PER_NODE = 2, 2


def mesh_2d() -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (NODES, PER_NODE), mesh_dim_names=("node", "local"))


def scope_kwargs(scope: str, stage: int) -> dict:
    """ZeroOptimizer arguments of a sharding scope over the 4 ranks."""
    if scope == "flat":
        return {"stage": stage}
    if scope == "hybrid":
        return {"stage": stage, "mesh": mesh_2d()}
    if scope == "hpz":
        return {"stage": stage, "mesh": mesh_2d(), "hpz": True}
    raise ValueError(scope)


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, world: int, start: int,
           stop: int) -> None:
    per = GLOBAL_BATCH // world
    for step in range(start, stop):
        batch = tokens(step)[rank * per:(rank + 1) * per]
        model(input_ids=batch, labels=batch).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        model.zero_grad()


def parity_worker(rank: int, world: int, out_path: str, ckpt: str) -> None:
    """hpZ against torch.optim.AdamW on one process (the drop-in loop, STEPS steps), the memory
    the secondary partition costs, and resume: 4 steps, save, 4 more, against a fresh model
    loading the step-4 checkpoint and doing the same 4 (bitwise)."""
    ref = gpt2()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    ref_out = train(ref, ref_opt, "loop", 0, 1)
    model = gpt2()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1, **scope_kwargs("hpz", 3))
    out = train(model, opt, "loop", rank, world)
    cons = opt.consolidated_state_dict(to_rank=None)["state"]  # (gathers through both levels)
    moments_diff = max(float((cons[i][k] - ref_opt.state[p][k]).abs().max())
                       for i, p in enumerate(ref.parameters()) for k in ("exp_avg", "exp_avg_sq"))
    got = weights(model, 3)
    diff = max(float((got[n] - p.detach()).abs().max()) for n, p in ref.named_parameters())
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(out["losses"], ref_out["losses"]))
    mem = opt.memory_report()
    units = [{"padded": u.layout.padded_numel, "elsize": u.flat.element_size()} for u in opt.units]

    def fresh() -> tuple[torch.nn.Module, Any]:
        m = gpt2()
        return m, zeroshard.ZeroOptimizer(m, torch.optim.AdamW, lr=1e-2, weight_decay=0.1, **scope_kwargs("hpz", 3))
    m1, o1 = fresh()
    _steps(m1, o1, rank, world, 0, 4)
    zeroshard.save_checkpoint(ckpt, 4, model=m1, optimizer=o1)
    _steps(m1, o1, rank, world, 4, 8)
    m2, o2 = fresh()
    zeroshard.load_checkpoint(ckpt, model=m2, optimizer=o2)
    _steps(m2, o2, rank, world, 4, 8)
    a, b = weights(m1, 3), weights(m2, 3)
    resume_equal = all(torch.equal(a[n], b[n]) for n in a)
    s1, s2 = ([o.inner.state[r.tensor] for r in o.engine.runs] for o in (o1, o2))
    moments_equal = all(sorted(x) == sorted(y) and all(torch.equal(torch.as_tensor(x[k]), torch.as_tensor(y[k]))
                                                       for k in x) for x, y in zip(s1, s2))
    # weights written outside the step reach the secondary partition (Note [hpZ secondary partition])
    fresh_ref = gpt2()
    model.load_state_dict(fresh_ref.state_dict())
    with torch.no_grad():
        for m in (model, fresh_ref):
            m.transformer.h[1].mlp.c_fc.weight.add_(0.5)
    part = tokens(0)[rank * (GLOBAL_BATCH // world):(rank + 1) * (GLOBAL_BATCH // world)]
    with torch.no_grad():
        written_loss = float(model(input_ids=part, labels=part).loss)
        ref_written_loss = float(fresh_ref(input_ids=part, labels=part).loss)
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump({"diff": diff, "loss_rel": loss_rel, "written_loss": written_loss, "moments_diff": moments_diff,
                   "ref_written_loss": ref_written_loss, "steps": STEPS, "resume_equal": resume_equal,
                   "moments_equal": moments_equal, "secondary": mem.secondary, "parameters": mem.parameters,
                   "units": units, "weights_sum": float(sum(got[n].double().sum() for n in got))}, f)


def traffic_worker(rank: int, world: int, out_path: str, configs: list[tuple[str, int, str]]) -> None:
    """One steady-state step (after a first one) of each (scope, stage, precision), measured in
    two phases: forward + backward, then the optimizer step. No clipping: the bulk traffic, plus
    the one control reduction a step makes (``grad_flags``)."""
    results = {}
    for scope, stage, precision in configs:
        model = gpt2()
        opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, **scope_kwargs(scope, stage),
                                      **({"mixed_precision": precision} if precision != "fp32" else {}))
        per = GLOBAL_BATCH // world
        phases = {}
        for step in range(2):
            opt.comm_report(reset=True)
            batch = tokens(step)[rank * per:(rank + 1) * per]
            model(input_ids=batch, labels=batch).loss.backward()
            phases["forward_backward"] = opt.comm_report(reset=True)
            opt.step()
            model.zero_grad()
            phases["step"] = opt.comm_report(reset=True)
        root = opt.engine.gatherer.root if opt.engine.gatherer is not None else None
        units = [{"numel": u.layout.numel, "padded": u.layout.padded_numel, "elsize": u.flat.element_size(),
                  "root": i == root, "tensors": len(u.layout.segments)} for i, u in enumerate(opt.units)]
        key = f"{scope}-{stage}" + ("" if precision == "fp32" else f"-{precision}")
        results[key] = {"phases": phases, "units": units, "memory": opt.memory_report().as_dict()}
        opt.close()
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump(results, f)


class Branchy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        return self.a(x) + self.b(x) if use_b else self.a(x)


def branch_worker(rank: int, world: int, out_path: str, scope: str, stage: int) -> None:
    """A layer used only on the ranks of the second node: under any scope every rank must step
    it alike (as DDP averages with zeros), or replicas drift apart silently."""
    model = Branchy()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.SGD, lr=0.1, **scope_kwargs(scope, stage))
    model(torch.ones(2, 4), use_b=rank >= PER_NODE).sum().backward()
    opt.step()
    got = weights(model, stage)
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump({n: t.flatten().tolist() for n, t in got.items()}, f)
