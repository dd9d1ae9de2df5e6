"""What checking NVMe swap traffic costs: write then read a set of regions through

- ``raw``: ``AsyncIO`` alone (what the swap files did before they were guarded);
- ``guarded``: ``zeroshard.offload.swap_file.SwapFile`` (identity and size checks around every
  request, and the 8-byte page samples of Note [zero-fill detection]): what runs now;
- ``crc32``: ``AsyncIO`` plus a CRC-32 (zlib, ``zeroshard.io.checksum``) of every region on
  write and a comparison on read, in the calling thread as the step would compute it.

    python benchmarks/bench_swap_checksum.py --dir /nvme/scratch --mb 512 --region-mb 16 --rounds 5

Prints each mode's throughput (GB/s of reads + writes, median of interleaved rounds) and its
cost against ``raw``. The page cache serves much of it on a small test machine: the cost of a
check is CPU time per byte, so a faster disk makes it a larger fraction, never a smaller one.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from zeroshard.io import aligned_empty, checksum
from zeroshard.offload.swap_file import SwapFile


def _rounds(args: argparse.Namespace, directory: str) -> dict[str, list[float]]:
    region = args.region_mb << 20
    n = max(1, args.mb // args.region_mb)
    bufs = [aligned_empty(region // 4, torch.float32) for _ in range(n)]
    for b in bufs:
        b.normal_()
    swap = SwapFile(directory, "bench", 0)
    swap.reserve(0, n * region, "the benchmark needs {gib} GiB")
    raw = swap.aio
    path = swap.path
    crcs = [0] * n

    def cycle(mode: str) -> float:
        t0 = time.perf_counter()
        if mode == "guarded":
            hs = [swap.pwrite(b, i * region) for i, b in enumerate(bufs)]
        else:
            if mode == "crc32":
                for i, b in enumerate(bufs):
                    crcs[i] = checksum(b)
            hs = [raw.pwrite(b, path, i * region) for i, b in enumerate(bufs)]
        for h in hs:
            h.wait()
        if mode == "guarded":
            hs = [swap.pread(b, i * region) for i, b in enumerate(bufs)]
        else:
            hs = [raw.pread(b, path, i * region) for i, b in enumerate(bufs)]
        for i, h in enumerate(hs):
            h.wait()
            if mode == "crc32" and checksum(bufs[i]) != crcs[i]:
                raise RuntimeError(f"region {i} read back different bytes")
        return 2 * n * region / (time.perf_counter() - t0) / 1e9

    times: dict[str, list[float]] = {m: [] for m in ("raw", "guarded", "crc32")}
    try:
        for m in times:  # warm-up: page cache, allocator, page samples
            cycle(m)
        for _ in range(args.rounds):
            for m in times:
                times[m].append(cycle(m))
    finally:
        swap.close()
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", help="directory on the disk to measure (default: a temporary directory)")
    p.add_argument("--mb", type=int, default=512, help="MiB written and read per round (default 512)")
    p.add_argument("--region-mb", type=int, default=16, help="MiB per request (default 16)")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    if args.dir:
        times = _rounds(args, args.dir)
    else:
        with tempfile.TemporaryDirectory() as d:
            times = _rounds(args, d)
    med = {m: statistics.median(v) for m, v in times.items()}
    print(f"swap traffic: {args.mb} MiB written + read per round in {args.region_mb} MiB requests, "
          f"median of {args.rounds} interleaved rounds, torch threads {torch.get_num_threads()}")
    print(f"{'mode':>8s} {'GB/s':>7s} {'cost vs raw':>12s}")
    for m, v in med.items():
        print(f"{m:>8s} {v:7.2f} {100 * (med['raw'] / v - 1):11.1f}%")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    main()
