"""CUDA multi-tensor Adam: bandwidth as a fraction of the device's copy bandwidth.

    python benchmarks/bench_adam_cuda.py [--numel 100] [--rounds 20] [--out result.json]

Copy bandwidth is ``dst.copy_(src)`` on 1 GiB (read + write). The fp32 step moves 28
bytes/param (read p, g, m, v; write p, m, v); the mixed step (bf16 grad in, bf16 copy out)
30 bytes/param. torch.optim.AdamW(fused=True)'s kernel runs in the same interleaved rounds.
Times are CUDA-event medians; nothing is asserted.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable

import torch


def _time_ms(fn: Callable[[], None]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def interleaved(cands: dict[str, Callable[[], None]], rounds: int) -> dict[str, float]:
    """Median milliseconds per candidate, every candidate once per round, rotating order."""
    names = list(cands)
    for name in names:  # warm-up (and lazy init) outside the measurement
        cands[name]()
    torch.cuda.synchronize()
    samples: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            samples[name].append(_time_ms(cands[name]))
    return {n: statistics.median(s) for n, s in samples.items()}


def _split(flat: torch.Tensor, pieces: int) -> list[torch.Tensor]:
    if pieces == 1:
        return [flat]
    gen = torch.Generator().manual_seed(0)
    w = torch.rand(pieces, generator=gen) ** 3 + 1e-4
    sizes = (w / w.sum() * flat.numel()).long().clamp(min=1)
    sizes[0] += flat.numel() - int(sizes.sum())
    return list(torch.split(flat, sizes.tolist()))


def run(numel: int, pieces: int, rounds: int) -> dict[str, float]:
    from zeroshard.ops import adam_step_multi_

    dev = torch.device("cuda")
    p, g = torch.randn(numel, device=dev), torch.randn(numel, device=dev) * 1e-2
    m, v = torch.zeros(numel, device=dev), torch.zeros(numel, device=dev)
    g16, out16 = g.bfloat16(), torch.empty(numel, device=dev, dtype=torch.bfloat16)
    P, G, M, V, G16, O16 = (_split(t, pieces) for t in (p, g, m, v, g16, out16))
    steps = [torch.tensor(1.0, device=dev) for _ in P]
    kw = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw_mode=True)
    src = torch.empty(1 << 28, device=dev)  # 1 GiB
    dst = torch.empty_like(src)
    ms = interleaved({
        "copy_1GiB": lambda: dst.copy_(src),
        "zeroshard_fp32": lambda: adam_step_multi_(P, G, M, V, **kw),
        "zeroshard_mixed": lambda: adam_step_multi_(P, G16, M, V, out_lowps=O16, grad_scale=1 / 1024, **kw),
        "torch_fused_fp32": lambda: torch._fused_adamw_(P, G, M, V, [], steps, lr=1e-3, beta1=0.9, beta2=0.999,
                                                        weight_decay=0.01, eps=1e-8, amsgrad=False, maximize=False),
    }, rounds)
    copy_gbps = 2 * src.numel() * 4 / ms["copy_1GiB"] / 1e6
    res = {"numel": numel, "pieces": pieces, "copy_GBps": copy_gbps}
    for name, nbytes in (("zeroshard_fp32", 28), ("zeroshard_mixed", 30), ("torch_fused_fp32", 28)):
        gbps = nbytes * numel / ms[name] / 1e6
        res[f"{name}_ms"] = ms[name]
        res[f"{name}_GBps"] = gbps
        res[f"{name}_frac_of_copy"] = gbps / copy_gbps
    res["speed_vs_torch_fused_fp32"] = ms["torch_fused_fp32"] / ms["zeroshard_fp32"]
    return res


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=100, help="millions of parameters")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 1
    from zeroshard.ops import kernel_status

    status = kernel_status()["cuda_adam"]
    print(f"{torch.cuda.get_device_name()}: cuda_adam active={status['active']} ({status['reason']})")
    if not status["active"]:
        return 1
    results = []
    for pieces in (1, 200):
        res = run(args.numel * 1_000_000, pieces, args.rounds)
        results.append(res)
        print(f"{args.numel}M x {pieces:3d}: copy {res['copy_GBps']:.0f} GB/s | "
              f"fp32 {res['zeroshard_fp32_GBps']:.0f} GB/s ({res['zeroshard_fp32_frac_of_copy']:.1%} of copy) | "
              f"mixed {res['zeroshard_mixed_GBps']:.0f} GB/s ({res['zeroshard_mixed_frac_of_copy']:.1%}) | "
              f"torch fused {res['torch_fused_fp32_frac_of_copy']:.1%} | "
              f"ours/torch speed {res['speed_vs_torch_fused_fp32']:.3f}x", flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
