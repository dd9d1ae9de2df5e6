"""Save and load speed of zeroshard's DCP path against its native path and against FSDP2's own
``dcp.save`` / ``dcp.load`` of the same state (issue 40), same run, gloo ranks on this machine.

    python benchmarks/bench_dcp.py --world 2 --layers 8 --width 1024 --rounds 3

Each round, on every rank: zeroshard (stage 2, AdamW after one step) saves natively and loads
it, saves ``format="dcp"`` and loads it; FSDP2 (``fully_shard`` per layer, AdamW after one
step) saves with ``dcp.save`` of ``get_state_dict`` and loads with ``dcp.load`` +
``set_state_dict``. Times are wall clock between barriers (rank 0's), the page cache warm (the
figures are the CPU path: serialization, checksums, copies; not the disk). Printed: the
median throughput (checkpoint bytes / s) of each, and the ratios DCP / native and DCP / FSDP2;
and the stall of an async save of each format (the call plus the wait for staging that an
optimizer step right after it would have: no overlap, the worst case).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import zeroshard  # noqa: E402
from zeroshard.testing.launch import spawn  # noqa: E402

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _model(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def _step(model: nn.Module, opt: torch.optim.Optimizer, width: int) -> None:
    model(torch.randn(4, width)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _timed(fn: Callable[[], object]) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _stall(save: Callable[[], "zeroshard.checkpoint.saver.PendingSave"]) -> float:
    """How long an async save holds training up if the next optimizer step came at once: the
    call plus the wait for staging (what the step's pre-hook waits for); then the commit."""
    from zeroshard.checkpoint.saver import _SAVER
    dist.barrier()
    t0 = time.perf_counter()
    handle = save()
    _SAVER._staged.wait()
    stall = time.perf_counter() - t0
    handle.wait()
    return stall


def rank_main(rank: int, world: int, out: str, layers: int, width: int, rounds: int, scratch: str) -> None:
    model = _model(layers, width)
    opt = zeroshard.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-3, stage=2)
    _step(model, opt, width)
    fmodel = _model(layers, width)
    for layer in fmodel:
        fully_shard(layer)
    fully_shard(fmodel)
    fopt = torch.optim.AdamW(fmodel.parameters(), lr=1e-3)
    _step(fmodel, fopt, width)
    times: dict[str, list[float]] = {}
    sizes: dict[str, int] = {}
    for r in range(rounds):
        native, ours, theirs = (os.path.join(scratch, f"{k}{r}") for k in ("native", "dcp", "fsdp"))
        times.setdefault("native save", []).append(_timed(lambda: zeroshard.save_checkpoint(
            native, 1, model=model, optimizer=opt).wait()))
        times.setdefault("native load", []).append(_timed(lambda: zeroshard.load_checkpoint(
            native, model=model, optimizer=opt)))
        times.setdefault("dcp save", []).append(_timed(lambda: zeroshard.save_checkpoint(
            ours, 1, model=model, optimizer=opt, format="dcp").wait()))
        times.setdefault("dcp load", []).append(_timed(lambda: zeroshard.load_checkpoint(
            ours, model=model, optimizer=opt)))

        for fmt in ("native", "dcp"):
            times.setdefault(f"{fmt} async stall", []).append(_stall(
                lambda: zeroshard.save_checkpoint(f"{native if fmt == 'native' else ours}-async", 1, model=model,
                                                  optimizer=opt, async_save=True, format=fmt)))

        def fsdp_save() -> None:
            msd, osd = get_state_dict(fmodel, fopt, options=FLAT)
            dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=theirs)

        def fsdp_load() -> None:
            msd, osd = get_state_dict(fmodel, fopt, options=FLAT)
            state = {"model": msd, "optimizer": osd}
            dcp.load(state, checkpoint_id=theirs)
            set_state_dict(fmodel, fopt, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                           options=FLAT)
        times.setdefault("fsdp2 save", []).append(_timed(fsdp_save))
        times.setdefault("fsdp2 load", []).append(_timed(fsdp_load))
        if rank == 0:
            sizes = {"native": _size(native), "dcp": _size(ours), "fsdp2": _size(theirs)}
            for p in (native, ours, theirs, native + "-async", ours + "-async"):
                shutil.rmtree(p, ignore_errors=True)
        dist.barrier()
    if rank == 0:
        json.dump({"times": times, "sizes": sizes}, open(out, "w"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    args = ap.parse_args()
    scratch = tempfile.mkdtemp(prefix="bench-dcp-", dir=args.dir)
    out = os.path.join(scratch, "result.json")
    try:
        spawn(rank_main, args.world, out, args.layers, args.width, args.rounds, scratch)
        res = json.load(open(out))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    speed = {}
    for what, ts in res["times"].items():
        fmt = what.split()[0]
        if what.endswith("stall"):
            print(f"{what:17s} median {statistics.median(ts) * 1e3:.1f} ms of {len(ts)}")
            continue
        speed[what] = res["sizes"][fmt] / statistics.median(ts)
        print(f"{what:12s} median {statistics.median(ts):.3f} s of {len(ts)} "
              f"({res['sizes'][fmt] / 2**20:.0f} MiB, {speed[what] / 2**20:.0f} MiB/s)")
    for op in ("save", "load"):
        print(f"{op}: dcp / native {speed[f'dcp {op}'] / speed[f'native {op}']:.2f}x, "
              f"dcp / fsdp2 {speed[f'dcp {op}'] / speed[f'fsdp2 {op}']:.2f}x")
    stall = {f: statistics.median(res["times"][f"{f} async stall"]) for f in ("native", "dcp")}
    print(f"async stall: dcp / native {stall['dcp'] / stall['native']:.2f}x")


if __name__ == "__main__":
    main()
