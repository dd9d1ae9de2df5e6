"""Ported from PyTorch's test/distributed/optim/test_zero_redundancy_optimizer.py; see tests/support/conformance/cases.py."""
from __future__ import annotations


import torch
import torch.distributed as dist
from torch import nn

import zeroshard
from tests.support.conformance.common import GLOBAL, _close, _local, _pair, _step_both, case
from tests.support.models import TinyNet, batch


# -- zero: test_zero_redundancy_optimizer.py ----------------------------------------------------
@case("zero: TestZeroRedundancyOptimizerSingleRank.test_state_dict (consolidate, lr kept)")
def zero_state_dict(rank: int, world: int) -> None:
    model, _ = _pair()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9, stage=1)
    model(_local(batch(0, GLOBAL), rank, world)).backward()
    opt.step()
    opt.param_groups[0]["lr"] = 0.02
    sd = opt.consolidated_state_dict(to_rank=None)
    other, _ = _pair(seed=3)
    o2 = zeroshard.ZeroOptimizer(other, torch.optim.SGD, lr=0.1, momentum=0.9, stage=1)
    o2.load_state_dict(sd)
    if o2.param_groups[0]["lr"] != 0.02:
        raise AssertionError("lr not restored")
    for p, q in zip(model.parameters(), other.parameters()):
        if p in opt.state and not torch.equal(opt.state[p]["momentum_buffer"], o2.state[q]["momentum_buffer"]):
            raise AssertionError("momentum differs after consolidate + load")


@case("zero: TestZeroRedundancyOptimizerSingleRank.test_lr_scheduler")
def zero_lr_scheduler(rank: int, world: int) -> None:
    model, ref = _pair()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.SGD, lr=0.1, stage=2)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scheds = [torch.optim.lr_scheduler.ExponentialLR(o, 0.7) for o in (opt, ropt)]
    for step in range(3):
        _step_both(model, opt, ref, ropt, step, rank, world)
        for s in scheds:
            s.step()
    _close(model, ref)


@case("zero: TestZeroRedundancyOptimizerSingleRank.test_step_with_kwargs / test_step_with_extra_inner_key")
def zero_step_kwargs(rank: int, world: int) -> None:
    class SGDWithKwargs(torch.optim.SGD):
        def step(self, closure=None, kwarg: float = 0.0):
            super().step()
            for g in self.param_groups:
                g["new_key"] = kwarg
    model, _ = _pair()
    opt = zeroshard.ZeroOptimizer(model, SGDWithKwargs, lr=0.1)
    model(_local(batch(0, GLOBAL), rank, world)).backward()
    opt.step(kwarg=2.0)
    if opt.inner.param_groups[0].get("new_key") != 2.0:
        raise AssertionError("kwarg did not reach the local optimizer")


@case("zero: TestZeroRedundancyOptimizerSingleRank.test_step_without_closure / with closure")
def zero_step_closure(rank: int, world: int) -> None:
    model, _ = _pair()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.SGD, lr=0.1, stage=2)

    def closure():
        opt.zero_grad()
        loss = model(_local(batch(0, GLOBAL), rank, world))
        loss.backward()
        return loss
    loss = opt.step(closure)
    if not torch.is_tensor(loss):
        raise AssertionError("step(closure) must return the closure's loss")


@case("zero: TestZeroRedundancyOptimizerSingleRank.test_constructor (params forms, refusals)")
def zero_constructor(rank: int, world: int) -> None:
    model = TinyNet()
    for params in (list(model.parameters()), [{"params": list(model.parameters())}]):
        zeroshard.ZeroOptimizer(params, torch.optim.SGD, lr=0.1).close()
    for bad, exc in ((next(model.parameters()), TypeError), (set(model.parameters()), TypeError)):
        try:
            zeroshard.ZeroOptimizer(bad, torch.optim.SGD, lr=0.1)
        except exc:
            continue
        raise AssertionError(f"{type(bad).__name__} params were accepted")


@case("zero: TestZeroRedundancyOptimizerDistributed.test_sharding (balanced partitions)")
def zero_sharding_balanced(rank: int, world: int) -> None:
    model = nn.Sequential(*[nn.Linear(9, 9) for _ in range(6)])
    opt = zeroshard.ZeroOptimizer(model, torch.optim.Adam, lr=1e-2, stage=2)
    owned = torch.tensor([float(sum(r.tensor.numel() for r in opt.engine.joined().runs))])
    if dist.is_initialized():
        sizes = [torch.zeros(1) for _ in range(world)]
        dist.all_gather(sizes, owned)
        spread = max(s.item() for s in sizes) - min(s.item() for s in sizes)
        if spread > 16 * world * max(1, len(opt.units)):
            raise AssertionError(f"owned sizes {sizes}")


@case("zero: TestZeroRedundancyOptimizerDistributed.test_multiple_param_groups")
def zero_multiple_param_groups(rank: int, world: int) -> None:
    def groups(m):
        return [{"params": [p for p in m.parameters() if p.dim() >= 2], "weight_decay": 0.1},
                {"params": [p for p in m.parameters() if p.dim() < 2], "weight_decay": 0.0, "lr": 3e-3}]
    for stage in (1, 2):
        model, ref = _pair()
        opt = zeroshard.ZeroOptimizer(groups(model), torch.optim.AdamW, lr=1e-2, stage=stage)
        ropt = torch.optim.AdamW(groups(ref), lr=1e-2)
        for step in range(3):
            _step_both(model, opt, ref, ropt, step, rank, world)
        _close(model, ref)


@case("zero: TestZeroRedundancyOptimizerSingleRank.test_add_param_group / torch: test_add_param_group")
def zero_add_param_group(rank: int, world: int) -> None:
    """A group added after some steps joins with its own hyperparameters; the existing
    state carries on (ZeroRedundancyOptimizer re-partitions; zeroshard rebuilds its units)."""
    for stage in (1, 2, 3):
        model, ref = _pair()
        late = [p for n, p in model.named_parameters() if n.endswith("bias")]
        rlate = [p for n, p in ref.named_parameters() if n.endswith("bias")]
        for p in late + rlate:
            p.requires_grad_(False)
        first = [p for p in model.parameters() if p.requires_grad]
        opt = zeroshard.ZeroOptimizer(first, torch.optim.AdamW, lr=1e-2, stage=stage,
                                      **({"module": model} if stage == 3 else {}))
        ropt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
        for step in range(4):
            if step == 2:
                for p in late + rlate:
                    p.requires_grad_(True)
                opt.add_param_group({"params": late, "lr": 3e-3, "weight_decay": 0.0})
                ropt.add_param_group({"params": rlate, "lr": 3e-3, "weight_decay": 0.0})
                if len(opt.param_groups) != 2 or opt.param_groups[1]["lr"] != 3e-3:
                    raise AssertionError(f"groups after add_param_group: {opt.param_groups}")
            _step_both(model, opt, ref, ropt, step, rank, world)
        _close(model, ref, stage)


class _Branchy(nn.Module):
    """Rank-dependent path: ``odd`` is used on odd ranks only, ``never`` on no rank."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(4, 4)
        self.even = nn.Linear(4, 1)
        self.odd = nn.Linear(4, 1)
        self.never = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, rank: int = 0) -> torch.Tensor:
        h = self.trunk(x)
        return (self.odd(h) if rank % 2 else self.even(h)).pow(2).mean()


@case("zero: test_local_optimizer_parity / ds: TestZeroUnusedParameters (unused on some / all ranks)")
def zero_unused_parameters(rank: int, world: int) -> None:
    for stage in (1, 2, 3):
        model, ref = _pair(cls=_Branchy)
        opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.5, stage=stage)
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.5)
        for step in range(3):
            x = torch.randn(GLOBAL, 4, generator=torch.Generator().manual_seed(step))
            opt.zero_grad()
            model(_local(x, rank, world), rank).backward()
            opt.step()
            ropt.zero_grad()
            (sum(ref(_local(x, r, world), r) for r in range(world)) / world).backward()
            ropt.step()
        _close(model, ref, stage)


@case("zero: TestZeroRedundancyOptimizerDistributed.test_collect_shards")
def zero_collect_shards(rank: int, world: int) -> None:
    opt = zeroshard.ZeroOptimizer(TinyNet(), torch.optim.Adam, lr=1e-2, stage=2)
    sd = opt.consolidated_state_dict(to_rank=0)
    if (sd is None) != (rank != 0):
        raise AssertionError(f"rank {rank} got {type(sd).__name__}")


@case("zero: TestZeroRedundancyOptimizerDistributed.test_nondefault_process_group / test_multiple_groups",
      worlds=(4,))
def zero_subgroup(rank: int, world: int) -> None:
    ranks = [0, 2] if rank % 2 == 0 else [1, 3]
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pg = groups[0] if rank % 2 == 0 else groups[1]
    sub_rank, sub_world = ranks.index(rank), 2
    model, ref = _pair()
    opt = zeroshard.ZeroOptimizer(model, torch.optim.Adam, lr=1e-2, stage=2, process_group=pg)
    ropt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for step in range(3):
        _step_both(model, opt, ref, ropt, step, sub_rank, sub_world)
    _close(model, ref)
