"""Which collective expresses a ZeRO operation fastest on this backend (gloo here).

    python benchmarks/bench_collectives.py [--mb 100 --rounds 6 --world-sizes 2,4]

Prints medians of interleaved rounds for: all-reduce (fp32), reduce-scatter, reduce to each
owner, all-gather, and one broadcast per owner; and the ratio of each to the all-reduce of
the same bytes. zeroshard/comm/process_group.py picks from these figures.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from zeroshard.comm.collective_names import all_gather_single, reduce_scatter_single
from zeroshard.testing.launch import spawn


def _worker(rank: int, world: int, numel: int, rounds: int) -> None:
    x = torch.randn(numel)
    n = numel // world
    own = x[rank * n:(rank + 1) * n].clone()
    ops = {
        "all_reduce": lambda: dist.all_reduce(x),
        "reduce_scatter": lambda: reduce_scatter_single(own, x),
        "reduce_to_owners": lambda: [w.wait() for w in [
            dist.reduce(x[i * n:(i + 1) * n], dst=i, async_op=True) for i in range(world)]],
        "all_gather": lambda: all_gather_single(x, own),
        "broadcast_per_owner": lambda: [w.wait() for w in [
            dist.broadcast(x[i * n:(i + 1) * n], src=i, async_op=True) for i in range(world)]],
    }
    times: dict[str, list[float]] = {k: [] for k in ops}
    for _ in range(rounds):
        for name, op in ops.items():
            dist.barrier()
            t0 = time.perf_counter()
            op()
            times[name].append(time.perf_counter() - t0)
    if rank == 0:
        base = statistics.median(times["all_reduce"])
        print(f"\nworld size {world}, {numel * 4 / 1e6:.0f} MB fp32, backend {dist.get_backend()}")
        print("| operation | median s | ÷ all_reduce |\n|---|---|---|")
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"| {name} | {med:.4f} | {med / base:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mb", type=float, default=100.0)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--world-sizes", default="2,4")
    a = ap.parse_args()
    numel = int(a.mb * 1e6 / 4) // 64 * 64
    for world in map(int, a.world_sizes.split(",")):
        spawn(_worker, world, numel, a.rounds, threads=1)


if __name__ == "__main__":
    main()
