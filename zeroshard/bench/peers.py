"""The trainers ``bench step`` compares, each behind the same three calls: ``step(x, y)`` (one
forward, backward and optimizer step), ``zero_grad()``, and ``model_state_bytes()`` (tensor
accounting of what the rank holds: parameters, gradients, optimizer state, fp32 master),
read between a step and ``zero_grad``, when gradients are still alive.

zeroshard_stageN: ZeroOptimizer(stage=N); single: one process, AdamW(fused=True); ddp: DDP +
AdamW(fused=True); ddp_zero1: DDP + torch's ZeroRedundancyOptimizer; fsdp2: fully_shard per
block (``reshard_after_forward=False``: ZeRO-2-like, parameters stay gathered until the step);
fsdp2_reshard: fully_shard resharding after forward (ZeRO-3-like); deepspeed_stageN:
deepspeed.initialize with ZeRO stage N.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

PEERS = ("single", "zeroshard_stage0", "zeroshard_stage1", "zeroshard_stage2", "zeroshard_stage3",
         "ddp", "ddp_zero1", "fsdp2", "fsdp2_reshard", "deepspeed_stage2")
DISTRIBUTED_ONLY = frozenset(PEERS) - {"single"}


def unique_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of distinct storages (a DTensor counts its local shard)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            continue
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def _state_tensors(opt: torch.optim.Optimizer) -> list:
    return [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


class Trainer:
    def __init__(self, step: Callable[[torch.Tensor, torch.Tensor], None], memory: Callable[[], int],
                 zero_grad: Callable[[], None] = lambda: None) -> None:
        self.step, self.model_state_bytes, self.zero_grad = step, memory, zero_grad


def _plain(model: nn.Module, module: nn.Module, opt: torch.optim.Optimizer, loss: Callable,
           states: Callable[[], list]) -> Trainer:
    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss(module, x, y).backward()
        opt.step()

    params = list(model.parameters())
    return Trainer(step, lambda: unique_bytes(params + [p.grad for p in params] + states()),
                   lambda: opt.zero_grad(set_to_none=True))


def build(kind: str, model: nn.Module, loss: Callable, local_batch: int) -> Trainer:
    """A trainer of ``kind`` around ``model``; raises (with the reason) where it cannot run."""
    if kind == "single":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        return _plain(model, model, opt, loss, lambda: _state_tensors(opt))
    if kind.startswith("zeroshard_stage"):
        import zeroshard

        zopt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-4, stage=int(kind[-1]))
        trainer = _plain(model, model, zopt, loss, lambda: [])
        trainer.model_state_bytes = lambda: zopt.memory_report().model_states
        return trainer
    if kind in ("ddp", "ddp_zero1"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model, gradient_as_bucket_view=True)
        if kind == "ddp":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
            return _plain(model, ddp, opt, loss, lambda: _state_tensors(opt))
        from torch.distributed.optim import ZeroRedundancyOptimizer

        zro = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4, fused=True)
        return _plain(model, ddp, zro, loss, lambda: _state_tensors(zro.optim))
    if kind in ("fsdp2", "fsdp2_reshard"):
        from torch.distributed.fsdp import fully_shard

        reshard = kind == "fsdp2_reshard"
        for block in _blocks(model):
            fully_shard(block, reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=reshard)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        return _plain(model, model, opt, loss, lambda: _state_tensors(opt))
    if kind.startswith("deepspeed_stage"):
        return _deepspeed(model, loss, local_batch, int(kind[-1]))
    raise ValueError(f"unknown configuration {kind!r}; known: {', '.join(PEERS)}")


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks (TinyGPT.blocks, or the largest ModuleList elsewhere)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList of blocks to shard with fully_shard")
    longest = max(lists, key=len)
    return list(longest)


def _deepspeed(model: nn.Module, loss: Callable, local_batch: int, stage: int) -> Trainer:
    import torch.distributed as dist

    import deepspeed  # ImportError / accelerator errors are reported as "could not run: ..."

    config = {"train_micro_batch_size_per_gpu": local_batch, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "zero_optimization": {"stage": stage}, "steps_per_print": 10**9}
    deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)
    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def held() -> int:
        inner = getattr(opt, "optimizer", opt)
        flat = [t for name in ("single_partition_of_fp32_groups", "bit16_groups_flat", "averaged_gradients")
                for t in _flatten(getattr(opt, name, None))]
        return unique_bytes(list(model.parameters()) + flat + _state_tensors(inner))

    last = [0]

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        engine.backward(loss(engine, x, y))
        last[0] = held()  # engine.step() also frees the gradients: count them before it
        engine.step()

    def memory() -> int:
        return max(last[0], held())

    return Trainer(step, memory)


def _flatten(x: Any) -> list:
    if x is None:
        return []
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        x = list(x.values())
    return [t for item in x for t in _flatten(item)]
