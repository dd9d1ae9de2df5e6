"""Shared helpers of the ported cases (tests/support/conformance/cases.py)."""
from __future__ import annotations

import tempfile
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

import zeroshard
from tests.support.models import TinyNet, batch

CASES: dict[str, tuple[str, tuple[int, ...], Callable[[int, int], None]]] = {}
GLOBAL = 8


def case(origin: str, worlds: tuple[int, ...] = (1, 2)) -> Callable:
    def register(fn: Callable[[int, int], None]) -> Callable[[int, int], None]:
        CASES[fn.__name__] = (origin, worlds, fn)
        return fn
    return register


# -- helpers ------------------------------------------------------------------------------------
def _pair(seed: int = 0, cls: type = TinyNet) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    a, b = cls(), cls()
    b.load_state_dict(a.state_dict())
    return a, b


def _local(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = x.shape[0] // world
    return x[rank * n:(rank + 1) * n]


def _step_both(model, opt, ref, ropt, step: int, rank: int, world: int, clip: float | None = None) -> None:
    """One step of zeroshard on this rank's share and of torch on the global batch; the mean
    over ranks of the per-rank mean losses equals the global mean loss (equal shares)."""
    x = batch(step, GLOBAL)
    opt.zero_grad()
    model(_local(x, rank, world)).backward()
    if clip:
        opt.clip_grad_norm_(clip)
    opt.step()
    ropt.zero_grad()
    ref(x).backward() if world == 1 else _mean_of_shares(ref, x, world).backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
    ropt.step()


def _mean_of_shares(ref: nn.Module, x: torch.Tensor, world: int) -> torch.Tensor:
    return sum(ref(_local(x, r, world)) for r in range(world)) / world


def _full(model: nn.Module, stage: int) -> dict:
    sd = zeroshard.full_state_dict(model, rank0_only=False) if stage == 3 else model.state_dict()
    return {k: v.detach().float() for k, v in sd.items()}


def _close(model, ref, stage: int = 0, atol: float = 1e-5) -> None:
    got, want = _full(model, stage), ref.state_dict()
    for k, v in want.items():
        diff = (got[k] - v.float()).abs().max().item()
        if diff > atol:
            raise AssertionError(f"{k}: max diff {diff:.3g} > {atol}")


def _shared_dir(rank: int) -> str:
    path = [tempfile.mkdtemp(prefix="zs-conf-") if rank == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(path, src=0)
    return path[0]


