"""The activation offloader's own CPU work per block, the file's checksum before and after Note
[activation file checksum] (zeroshard/offload/activations/block_record.py): one real
``BlockActivations`` record of a TinyGPT-like block's saved tensors moved out to a file through the
offloader's I/O engine and read back, with the earlier checksum (copy, then zlib's crc32 of the
buffer, and again after the read) and with CRC-32C computed during the copy (and on the read).

    python benchmarks/bench_activation_checksum.py --dir /nvme/tmp          # 8 x 512 tokens, d_model 128
    python benchmarks/bench_activation_checksum.py --dir DIR --tokens 16384 --rounds 15

Each round runs both, interleaved, in one process; the figures are medians (the machine is shared:
the ratio moves less than the times). The I/O itself is the same bytes either way.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from zeroshard.io.aio_engine import AsyncIO
from zeroshard.offload.activations.block_record import BlockActivations
from zeroshard.resilience import checksum


def _saved(tokens: int, d_model: int) -> list[torch.Tensor]:
    """A pre-norm block's saved tensors at this width (planner/activations.py's list, 17 x d per token)."""
    widths = [1, 1, 3, 1, 1, 1, 1, 4, 4]  # LN1 in, qkv in, q/k/v, attention out, proj in, LN2 in, fc in, fc out, GELU out
    return [torch.randn(tokens, w * d_model) for w in widths]


def _once(tensors: list[torch.Tensor], io: AsyncIO, directory: str, algorithm: str, call: int) -> tuple[float, float]:
    """(seconds of the copy out and its check, seconds of the read back's wait and check)."""
    record = BlockActivations("block", call, torch.device("cpu"), algorithm=algorithm)
    for t in tensors:
        record.add(t)
    t0 = time.perf_counter()
    record.move_out(io, directory)
    out = time.perf_counter() - t0
    record.written(wait=True)
    t0 = time.perf_counter()
    back = [record.tensor(i, io) for i in range(len(tensors))]
    load = time.perf_counter() - t0
    if not all(torch.equal(a, b) for a, b in zip(tensors, back)):
        raise RuntimeError("a tensor came back different")
    record.discard()
    return out, load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dir", default=None, help="directory for the files (default: a temporary one)")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=11)
    args = ap.parse_args()
    if checksum.native() is None:
        raise SystemExit(f"the CRC-32C kernel is not available here ({checksum.reason}): nothing to compare")
    tensors = _saved(args.tokens, args.d_model)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    io = AsyncIO()
    times: dict[str, list[float]] = {"crc32": [], "crc32c": []}
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        try:
            for r in range(args.rounds):
                for algorithm in times:
                    out, load = _once(tensors, io, directory, algorithm, r)
                    times[algorithm].append(out + load)
        finally:
            io.close()
    before, after = statistics.median(times["crc32"]), statistics.median(times["crc32c"])
    print(json.dumps({"bytes_per_record": nbytes, "rounds": args.rounds,
                      "before_crc32_s": before, "after_crc32c_s": after, "before_over_after": before / after,
                      "before_s_per_gb": before / nbytes * 1e9, "after_s_per_gb": after / nbytes * 1e9}))


if __name__ == "__main__":
    main()
