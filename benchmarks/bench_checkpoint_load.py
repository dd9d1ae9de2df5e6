"""The checkpoint load's memory and reader threads (issue 17), cold page cache each load.

    python benchmarks/bench_checkpoint_load.py memory --bucket-mb 64
    python benchmarks/bench_checkpoint_load.py workers

``memory``: peak RSS growth and time of one load_checkpoint of a 2 GB state (fp32 + AdamW),
as loads run (fresh buffers, verified, then copied in) and with the streamed path forced on
in-memory state (a few blocks verified at a time, then each unit re-read to apply it).
``workers``: load speed with 2, 4, 6 and 8 reader threads, next to dd in the same round.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_checkpoint  # noqa: E402
import zeroshard  # noqa: E402
from zeroshard.checkpoint import load as load_mod, shard_file  # noqa: E402


_status = bench_checkpoint._status


def memory(d: str, model: torch.nn.Module, opt: zeroshard.ZeroOptimizer) -> None:
    nbytes = sum(p.numel() * 12 for p in model)
    for mode in ("verify-then-apply", "two-reads"):
        load_mod._streamed = (lambda o: True) if mode == "two-reads" else (lambda o: getattr(o, "unit_store", None)
                                                                          is not None)
        for _ in range(2):
            bench_checkpoint.drop_cache(d)
            time.sleep(1.0)  # the previous load's buffers are unmapped
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5\n")  # VmHWM := VmRSS
            base = _status("VmRSS:")
            t0 = time.perf_counter()
            info = zeroshard.load_checkpoint(d, model=model, optimizer=opt)
            took = time.perf_counter() - t0
            print(f"{mode}: state {nbytes / 2**30:.2f} GiB, peak RSS growth {(_status('VmHWM:') - base) / 2**30:.2f} "
                  f"GiB, {took:.2f} s, read {info['bytes_read'] / 2**30:.2f} GiB")


def workers(d: str, model: torch.nn.Module, opt: zeroshard.ZeroOptimizer, rounds: int) -> None:
    nbytes = sum(p.numel() * 12 for p in model)
    speeds: dict[str, list[float]] = {}
    for _ in range(rounds):
        speeds.setdefault("dd", []).append(bench_checkpoint.dd_speed(d, nbytes)[1])
        for n in (2, 4, 6, 8):
            shard_file._IO_POOL = ThreadPoolExecutor(max_workers=n, thread_name_prefix="zeroshard-read")
            bench_checkpoint.drop_cache(d)
            t0 = time.perf_counter()
            zeroshard.load_checkpoint(d, model=model, optimizer=opt)
            speeds.setdefault(f"{n} workers", []).append(nbytes / (time.perf_counter() - t0))
            time.sleep(0.5)
    for k, v in speeds.items():
        print(f"{k:10s} " + " ".join(f"{x / 1e9:.2f}" for x in v) + " GB/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["memory", "workers"])
    ap.add_argument("--size-gb", type=float, default=2.0)
    ap.add_argument("--bucket-mb", type=int, default=512, help="unit size of the optimizer (the streamed "
                    "path's memory is one unit's bytes)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    # bench_checkpoint's model, with this unit size (build() names zeroshard.ZeroOptimizer only)
    bench_checkpoint.zeroshard = type("Z", (), {"ZeroOptimizer": staticmethod(
        lambda *a, **k: zeroshard.ZeroOptimizer(*a, **{**k, "bucket_size_mb": args.bucket_mb}))})
    try:
        model, opt = bench_checkpoint.build(args.size_gb)
    finally:
        bench_checkpoint.zeroshard = zeroshard
    with tempfile.TemporaryDirectory(prefix="zeroshard-loadbench-", dir="/tmp") as d:
        zeroshard.save_checkpoint(d, 1, model=model, optimizer=opt, keep_last=1)
        if args.what == "memory":
            memory(d, model, opt)
        else:
            workers(d, model, opt, args.rounds)


if __name__ == "__main__":
    main()
