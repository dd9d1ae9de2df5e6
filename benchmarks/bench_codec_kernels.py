"""Encode + decode throughput of the C++ block codecs against the torch-op path they equal bit
for bit (zeroshard/comm/codecs/codec_formats.py; csrc/adam/codec_int8.cpp, codec_fp8_int4.cpp
and their AVX2 builds in codec_blocks_avx2.cpp), and against a plain fp32 copy of the same
values (the memory ceiling's peer: a codec reads the values and writes about a quarter of their
bytes, twice).

    python benchmarks/bench_codec_kernels.py                 # 4M values, block 256, 9 rounds
    python benchmarks/bench_codec_kernels.py --mb 4 --rounds 5

Each round times every path once, interleaved, in one process; the figures are medians over
rounds of per-round ratios (the machine is shared: absolute times move, ratios less).
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from zeroshard.comm.codecs.codec_formats import Fp8Codec, Int4Codec, Int8Codec, _codec_kernel


def _timed(fn: Callable[[], None]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mb", type=float, default=16.0, help="fp32 values per call, in MB")
    ap.add_argument("--block", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    n = int(args.mb * 1e6 / 4)
    x = torch.randn(n) * torch.logspace(-3, 3, n)
    copy_out = torch.empty_like(x)
    kernel = _codec_kernel("int8", x, torch.empty(1, dtype=torch.uint8))
    if kernel is None:
        raise SystemExit("the CPU kernel is not built here (python -m zeroshard.ops says why)")
    isa = kernel.isa()
    paths: dict[str, Callable[[], None]] = {"copy": lambda: copy_out.copy_(x)}
    for codec in (Int8Codec(args.block), Fp8Codec(args.block), Int4Codec(args.block)):
        buf = torch.empty(codec.encoded_bytes(n), dtype=torch.uint8)
        out = torch.empty(n)

        def torch_path(c=codec, b=buf, o=out) -> None:
            c.reference_encode(x, b)
            c.reference_decode(b, o)

        def kernel_path(c=codec, b=buf, o=out) -> None:
            c.encode(x, b)
            c.decode(b, o)
        paths[f"{codec.name} torch"] = torch_path
        if isa != "scalar":
            def scalar_path(c=codec, b=buf, o=out) -> None:
                kernel.set_isa("scalar")
                try:
                    c.encode(x, b)
                    c.decode(b, o)
                finally:
                    kernel.set_isa(isa)
            paths[f"{codec.name} C++ portable"] = scalar_path
        paths[f"{codec.name} C++ {isa}"] = kernel_path
    for fn in paths.values():  # (warm: page faults, the kernel's first call)
        fn()
    times: dict[str, list[float]] = {k: [] for k in paths}
    for _ in range(args.rounds):
        for name, fn in paths.items():
            times[name].append(_timed(fn))
    print(f"{n:,} fp32 values ({args.mb:g} MB), block {args.block}, {torch.get_num_threads()} threads, "
          f"C++ dispatch {isa}, median of {args.rounds} rounds")
    print("| path (encode + decode) | median ms | GB/s of fp32 values | ÷ torch path (same codec) | ÷ fp32 copy |")
    print("|---|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        base = f"{name.split()[0]} torch"
        vs_torch = statistics.median(t / b for t, b in zip(times[base], ts)) if base in times and name != base else None
        vs_copy = statistics.median(t / c for t, c in zip(ts, times["copy"]))
        print(f"| {name} | {med * 1e3:.2f} | {4 * n / med / 1e9:.2f} | "
              f"{f'{vs_torch:.2f}x faster' if vs_torch else '-'} | {vs_copy:.2f} |")


if __name__ == "__main__":
    main()
